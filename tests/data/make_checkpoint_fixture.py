"""Writes ``tests/data/checkpoint_v1``: the committed checkpoints of a small job, kept in the
repository so that a later planaria must still restore them (tests/test_checkpoint_fixture.py).

    python tests/data/make_checkpoint_fixture.py

Run it only to add a fixture of a new format (as a new folder): the committed one is what
users' checkpoints look like, and replacing it would test nothing.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

N, STEPS, EVERY = 256, 4, 2
"""The job: ``planaria.examples.mlp.make_spec(n=N)``, STEPS steps on 2 replicas, a save every
EVERY steps and the final one."""


def main() -> None:
    import planaria
    from planaria import CheckpointConfig  # exported since this fixture's version
    from planaria.examples import mlp

    out = HERE / "checkpoint_v1"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        planaria.fit(mlp.make_spec(n=N), steps=STEPS, replicas=2, run_dir=Path(tmp) / "run",
                     checkpoint=CheckpointConfig(root=str(root), every=EVERY, fsync=False))
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(root, out)
    for p in sorted(out.rglob("*")):
        print(p.relative_to(out), p.stat().st_size if p.is_file() else "")


if __name__ == "__main__":
    main()
