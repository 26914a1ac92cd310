"""Baselines that planaria's benchmarks run side by side with it.

- ``ddp_train.py``: plain PyTorch DDP under torchrun (steady-state step time).
- ``ddp_ckpt_restart.py``: DDP with periodic checkpoints, restarted by torchrun
  after a worker dies (the classic recovery path).
- ``torchft_train.py``: torchft 0.2.0 replica groups with a lighthouse (survivors
  keep training, the replacement heals from a peer).
- ``runners.py``: Python functions that launch the DDP and torchrun ones as real
  processes on 127.0.0.1 and return figures (``run_ddp_steady``, ``run_torchrun_kill``);
  ``torchft_runners.py`` the torchft ones (``run_torchft_kill``, ...); ``launch.py``
  what they share (processes, waits, logs, the recovery figures).

All of them train ``bench.common``'s workload: same model, samples per step and
global batch as planaria.
"""
