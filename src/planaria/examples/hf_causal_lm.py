"""A Hugging Face causal LM trained by ``ElasticTrainer``: a tiny GPT-2 built from a config
(nothing downloaded), on byte-level text found on every machine (the Python standard
library's source files), as a ``datasets.Dataset``.

Run it (``pip install "planaria[hf]"``)::

    python examples/hf_causal_lm.py --replicas 3 --steps 60 --chaos kill:w1@step20

It is ``transformers.Trainer``'s script with ``Trainer`` replaced by ``ElasticTrainer`` and
``replicas=`` / ``chaos=`` added; the final model lands in ``--output-dir`` (``save_pretrained``).
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path
from typing import Any

BLOCK = 32  # bytes a sample
VOCAB = 256  # one token a byte


def text_dataset(samples: int = 2048) -> Any:
    """``samples`` rows of BLOCK bytes of the stdlib's source, as input_ids and labels (the
    model shifts the labels itself), plus the text (a column the model does not take:
    ElasticTrainer removes it, as Trainer does)."""
    import datasets

    root = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for path in sorted(root.glob("*.py")):
        data += path.read_bytes()
        if len(data) >= samples * BLOCK:
            break
    rows = [list(data[i * BLOCK:(i + 1) * BLOCK]) for i in range(samples)]
    return datasets.Dataset.from_dict({
        "input_ids": rows, "labels": rows,
        "text": [bytes(r).decode("utf-8", "replace") for r in rows],
    })


def tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=BLOCK,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--chaos", default=None, help="e.g. kill:w1@step20")
    parser.add_argument("--output-dir", default="runs/hf_causal_lm")
    options = parser.parse_args(argv)

    from transformers import PrinterCallback, TrainingArguments

    from planaria.integrations.transformers import ElasticTrainer

    args = TrainingArguments(
        output_dir=options.output_dir,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,   # x replicas at start: the global batch, kept fixed
        max_steps=options.steps,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=0.1,
        weight_decay=0.1,                # Trainer's no-decay groups for biases and norms
        max_grad_norm=1.0,
        logging_steps=10,
        save_steps=20,                   # planaria checkpoints in output_dir/planaria
        seed=0,
        report_to="none",
    )
    trainer = ElasticTrainer(model=tiny_gpt2(), args=args, train_dataset=text_dataset(),
                             callbacks=[PrinterCallback()],  # on_log: prints the logs
                             replicas=options.replicas, chaos=options.chaos)
    output = trainer.train()
    print(f"trained {output.global_step} steps, mean loss {output.training_loss:.3f}; "
          f"model saved in {options.output_dir}")
    return trainer


if __name__ == "__main__":
    main()
