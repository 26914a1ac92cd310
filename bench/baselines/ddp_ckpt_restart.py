"""DDP with periodic checkpoints, restarted by torchrun after a failure.

The classic recovery path: rank 0 saves model + optimizer + step every
``--ckpt-every`` steps (``torch.save`` to a temporary file, then an atomic
``os.replace``); when any worker dies, torchrun's agent stops the others and
starts them all again (``--max-restarts``), and they resume from the latest
checkpoint, recomputing the steps done since.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=3 --max-restarts=3 \\
        bench/baselines/ddp_ckpt_restart.py --steps 60 --ckpt /tmp/ck.pt --out log.jsonl

(On torch 2.13 with gloo, restarted workers often hang in process-group setup
when they share the agent's rendezvous store; the environment variable above
makes each round build its own store.)

Log (JSON lines, ``--out``): every rank writes ``{"event": "start", "rank",
"pid", "restart", "resume_step", "wall"}`` when it starts; rank 0 writes
``{"event": "step", "step", "wall", "step_ms", "restart", ...}`` after each
step's optimizer update and ``{"event": "ckpt", "step", "wall", "save_ms"}``
after each checkpoint (``step`` = the next step to run).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

_LAUNCHED = time.time()  # before importing torch: when torchrun (re)started this worker
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ddp_train import (  # noqa: E402
    JsonLog,
    end_after_the_group,
    make_parser,
    setup,
    start_record,
    train_step,
)


def save(path: str, model, optimizer, next_step: int) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    state = {
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": next_step,
    }
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: str, model, optimizer) -> int:
    """Loads the checkpoint if there is one; returns the step to run next."""
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(steps=60)
    parser.add_argument("--ckpt", default="ddp_ckpt.pt", help="checkpoint file (one, replaced)")
    parser.add_argument("--ckpt-every", type=int, default=20, help="steps between checkpoints")
    args = parser.parse_args(argv)
    ckpt = args.ckpt
    model, optimizer, dataset = setup(args)
    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    # Every rank reads the same committed file, so all replicas start equal.
    start = load(ckpt, model, optimizer)
    log = JsonLog(args.out)
    log.write(**start_record(args, resume_step=start, launched_wall=_LAUNCHED))
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, dataset, step, args)
        step_ms = (time.perf_counter() - t0) * 1000
        if rank == 0:
            log.write(
                event="step",
                step=step,
                wall=time.time(),
                step_ms=step_ms,
                loss=loss,
                restart=restart,
                warmup=step - start < args.warmup,
            )
        if (step + 1) % args.ckpt_every == 0:
            if rank == 0:
                t1 = time.perf_counter()
                save(ckpt, model, optimizer, step + 1)
                log.write(
                    event="ckpt",
                    step=step + 1,
                    wall=time.time(),
                    save_ms=(time.perf_counter() - t1) * 1000,
                )
            dist.barrier()  # nobody runs ahead of a checkpoint that is not yet on disk
    dist.barrier()
    end_after_the_group()


if __name__ == "__main__":
    main()
