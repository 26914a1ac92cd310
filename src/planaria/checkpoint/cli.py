"""What ``planaria ckpt ls|verify|export`` print: plain functions returning data."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from safetensors.torch import save as safetensors_save

from planaria.checkpoint.layout import parse_dir_name
from planaria.checkpoint.restore import (
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    verify_checkpoint,
)
from planaria.checkpoint.storage import Storage

__all__ = ["CHECKPOINTS_SUBDIR", "export", "ls", "resolve_root", "verify"]

#: Where a run keeps its checkpoints, under its run directory.
CHECKPOINTS_SUBDIR = "checkpoints"
MODEL_PREFIX = "model/"


def resolve_root(run_dir_or_root: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """The checkpoint root for a run directory (its ``checkpoints/``) or a root itself."""
    st = Storage(run_dir_or_root, storage_options)
    if any(parse_dir_name(n) for n in st.listdir()):
        return run_dir_or_root
    if CHECKPOINTS_SUBDIR in st.listdir():
        return run_dir_or_root.rstrip("/") + "/" + CHECKPOINTS_SUBDIR
    return run_dir_or_root


def ls(
    run_dir_or_root: str,
    *,
    verify: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One row per step directory, oldest first: ``step``, ``path``, ``bytes``,
    ``committed``, ``verified`` (None unless ``verify``: that reads every byte)."""
    root = resolve_root(run_dir_or_root, storage_options)
    rows = []
    for c in list_checkpoints(root, storage_options=storage_options):
        verified = None
        if verify:
            verified = c.committed and verify_checkpoint(
                c.path, storage_options=storage_options).ok
        rows.append({"step": c.step, "path": c.path, "bytes": c.nbytes,
                     "committed": c.committed, "verified": verified})
    return rows


def verify(path: str, *, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Verifies one checkpoint: ``path``, ``step``, ``ok``, ``problems``, ``bytes``,
    ``seconds``."""
    r = verify_checkpoint(path, storage_options=storage_options)
    return {"path": r.path, "step": r.step, "ok": r.ok, "problems": list(r.problems),
            "bytes": r.nbytes, "seconds": round(r.seconds, 3)}


def export(
    path: str,
    out_file: str,
    *,
    prefix: str = MODEL_PREFIX,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Writes the model weights of a checkpoint (verified) as one safetensors file,
    names without ``prefix``, loadable by ``safetensors.torch.load_file``. ``out_file``
    may be any fsspec URL. Returns ``out_file``, ``step``, ``tensors``, ``bytes``."""
    manifest = read_manifest(path, storage_options=storage_options)
    names = [n for n in manifest.tensors if n.startswith(prefix)]
    tensors, _ = load_checkpoint(path, names=names, storage_options=storage_options)
    weights = {n[len(prefix):]: t.contiguous() for n, t in tensors.items()}
    data = safetensors_save(weights, metadata={"format": "pt", "step": str(manifest.step)})
    out = Storage(out_file, storage_options)
    out.write_bytes(out.root, data)
    return {"out_file": out_file, "step": manifest.step, "tensors": len(weights),
            "bytes": len(data)}
