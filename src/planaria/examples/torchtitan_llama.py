"""torchtitan's debug Llama trained elastic: ``llama3_debugmodel()``'s Trainer.Config (its
model, chunked cross-entropy, AdamW, warm-up and decay, clipping, batch sizes) run by
planaria, on byte-level tokens found on every machine (the Python standard library's source
files), cut into windows by ``TokenWindows``.

Run it (``pip install "planaria[torchtitan]"``)::

    python examples/torchtitan_llama.py --replicas 2 --steps 20 --chaos kill:w1@step5

On the CPU the model is shrunk (``--layers``, default 2 of its 6) and its flex attention,
which has no backward on the CPU, is replaced by torchtitan's SDPA attention (one document
per window: both are causal attention); the rest is the config as torchtitan ships it.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path
from typing import Any

SEQ_LEN = 32  # tokens a sample (a multiple of the chunked loss's 8 chunks)


def stdlib_bytes(count: int) -> Any:
    """``count`` bytes of the standard library's source, one token a byte (vocab 256)."""
    import torch

    data = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data += path.read_bytes()
        if len(data) >= count:
            break
    return torch.frombuffer(bytearray(data[:count]), dtype=torch.uint8).long()


def windows(samples: int = 1024) -> Any:
    """The map-style dataset: ``samples`` windows of SEQ_LEN tokens."""
    from planaria.integrations.torchtitan import TokenWindows

    return TokenWindows(stdlib_bytes(samples * SEQ_LEN + 1), SEQ_LEN)


def config(steps: int, layers: int) -> Any:
    """``llama3_debugmodel()``, shrunk for the CPU."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    job = llama3_debugmodel()
    model = job.model_spec.model
    model.layers = model.layers[:layers]
    for layer in model.layers:  # flex attention has no backward on the CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    job.training.seq_len, job.training.local_batch_size, job.training.steps = SEQ_LEN, 4, steps
    job.lr_scheduler.warmup_steps = max(1, steps // 10)
    return job


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chaos", default=None, help="e.g. kill:w1@step5")
    parser.add_argument("--run-dir", default="runs/torchtitan_llama")
    options = parser.parse_args(argv)

    from planaria.integrations.torchtitan import fit_torchtitan

    result = fit_torchtitan(config(options.steps, options.layers), windows,
                            replicas=options.replicas, run_dir=options.run_dir,
                            chaos=options.chaos)
    print(f"trained {result.final_step} steps: loss {result.losses.values[0]:.3f} -> "
          f"{result.losses.values[-1]:.3f}; events in {options.run_dir}/events.jsonl")
    return result


if __name__ == "__main__":
    main()
