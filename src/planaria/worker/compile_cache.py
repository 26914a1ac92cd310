"""Compiled models that join warm: ``torch.compile`` in every worker, one compile cache
handed from worker to worker.

``TrainSpec(compile=True)`` compiles the model in every worker
(``dynamic=False``: a micro-batch always has ``micro_batch_size`` samples, so
the graph depends neither on the width nor on a rank's number of
micro-batches, and a change of width compiles nothing). Each worker keeps
Inductor's on-disk cache in a directory of its own; the controller packs one
healthy worker's directory (a few MB: the generated code and the compiled
kernels, which Inductor would otherwise rebuild with the C++ compiler) once
after the first step, keeps it, saves it as ``RUN_DIR/compile_cache.tar.gz``
for a resumed job, and gives it to every worker it starts later. A worker
given a cache unpacks it before it compiles, in its setup (one forward and
backward on a real micro-batch, the model's state put back afterwards), so a
replacement or a spare is warm before it joins. Measured on the 2-core
machine: the tiny GPT's first forward+backward 37 s cold, 2 s from a handed-
over cache. (``torch.compiler.save_cache_artifacts`` alone was not enough
there: its artifacts still left 26 s of C++ compilation.)
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from pathlib import Path

__all__ = ["CACHE_FILE", "pack", "unpack", "use_private_cache"]

#: The packed cache in the run directory (for a resumed job).
CACHE_FILE = "compile_cache.tar.gz"


def use_private_cache(seed: bytes | None = None) -> Path:
    """Points Inductor at a new directory of this process's own (before any compile) and
    returns it; ``seed``, a cache :func:`pack` made (another worker's), is unpacked in it."""
    path = Path(tempfile.mkdtemp(prefix="planaria-inductor-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    if seed:
        unpack(seed, path)
    return path


def pack(directory: Path) -> bytes:
    """The directory's files as a gzipped tar (paths relative to it)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        tar.add(str(directory), arcname=".")
    return buf.getvalue()


def unpack(data: bytes, directory: Path) -> None:
    """Unpacks what :func:`pack` made into ``directory``; refuses links and paths that
    leave it (the bytes come from another process, maybe another node)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(str(directory), filter="data")
