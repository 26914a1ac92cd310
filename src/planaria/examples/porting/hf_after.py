"""The same training as hf_before.py, on planaria (the "after" of docs/porting.md).
Run: python hf_after.py (three replicas, a worker killed at step 20)"""

from transformers import TrainingArguments

from planaria.examples.hf_causal_lm import text_dataset, tiny_gpt2
from planaria.integrations.transformers import ElasticTrainer

args = TrainingArguments(
    output_dir="runs/hf",
    per_device_train_batch_size=8,
    gradient_accumulation_steps=1,
    max_steps=60,
    learning_rate=3e-3,
    lr_scheduler_type="cosine",
    warmup_steps=6,
    weight_decay=0.1,
    max_grad_norm=1.0,
    logging_steps=10,
    save_steps=20,
    eval_strategy="steps",
    eval_steps=20,
    seed=0,
    report_to="tensorboard",
)
data = text_dataset().train_test_split(test_size=64, seed=0)
trainer = ElasticTrainer(
    model=tiny_gpt2(),
    args=args,
    train_dataset=data["train"],
    eval_dataset=data["test"],
    replicas=3,
    chaos="kill:w1@step20",
)
trainer.train()
