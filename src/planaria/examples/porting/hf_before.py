"""A Hugging Face Trainer script, as users write it (the "before" of docs/porting.md).
Run: torchrun --nproc-per-node 3 hf_before.py"""

from transformers import Trainer, TrainingArguments

from planaria.examples.hf_causal_lm import text_dataset, tiny_gpt2

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
trainer = Trainer(
    model=tiny_gpt2(),
    args=args,
    train_dataset=data["train"],
    eval_dataset=data["test"],
)
trainer.train()
