"""Property tests of the manifest parser: garbage never crashes it, valid ones round-trip."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planaria.checkpoint import Manifest, ManifestError, parse_manifest
from planaria.checkpoint.dtypes import DTYPES
from planaria.checkpoint.manifest import FileEntry, SliceEntry, TensorEntry

EXAMPLES = 100  # a few seconds per property on a small CPU machine
pytestmark = pytest.mark.slow

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(
    allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=4),
    max_leaves=20,
)
names = st.text(alphabet="abcxyz019_./[]:", min_size=1, max_size=12).filter(
    lambda s: not s.endswith("]"))


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    """A valid manifest: tensors laid out in files, some split into row slices."""
    num_files = draw(st.integers(1, 4))
    file_names = [f"shard-{i + 1:05d}-of-{num_files:05d}.safetensors" for i in range(num_files)]
    starts = [8 * draw(st.integers(1, 64)) for _ in file_names]
    pos = list(starts)
    tensors: dict[str, TensorEntry] = {}
    for name in draw(st.lists(names, unique=True, max_size=6)):
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        item = DTYPES[dtype].itemsize
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        row_bytes = math.prod(shape[1:]) * item
        if shape and shape[0] > 1 and draw(st.booleans()):
            cuts = sorted(draw(st.sets(st.integers(1, shape[0] - 1), max_size=3)))
            bounds = [0, *cuts, shape[0]]
            pieces = [(a, b) for a, b in itertools.pairwise(bounds)]
        else:
            pieces = [None]
        slices = []
        for rows in pieces:
            f = draw(st.integers(0, num_files - 1))
            nbytes = math.prod(shape) * item if rows is None else (rows[1] - rows[0]) * row_bytes
            key = name if rows is None else f"{name}[{rows[0]}:{rows[1]}]"
            crc = draw(st.integers(0, 2**32 - 1))
            slices.append(SliceEntry(file_names[f], key, rows, (pos[f], pos[f] + nbytes), crc))
            pos[f] += nbytes
        tensors[name] = TensorEntry(dtype, shape, tuple(slices))
    files = tuple(
        FileEntry(n, p, s, draw(st.integers(0, 2**32 - 1)))
        for n, p, s in zip(file_names, pos, starts, strict=True)
    )
    return Manifest(
        step=draw(st.integers(0, 10**9)),
        world_size=draw(st.integers(1, 64)),
        save_id=draw(st.text(alphabet="0123456789abcdef", min_size=1, max_size=12)),
        files=files,
        tensors=tensors,
        meta=draw(st.dictionaries(st.text(max_size=8), json_values, max_size=4)),
        user_metadata=draw(st.dictionaries(st.text(max_size=8), json_scalars, max_size=3)),
        planaria_version="0.1.0",
        torch_version="2.13.0",
        created_t=draw(st.floats(0, 2e9)),
    )


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(manifests())
def test_valid_manifests_round_trip(m: Manifest) -> None:
    assert parse_manifest(m.to_json()) == m


@settings(max_examples=EXAMPLES)
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_manifest_error(data: bytes) -> None:
    with contextlib.suppress(ManifestError):
        parse_manifest(data)


@settings(max_examples=EXAMPLES)
@given(json_values)
def test_random_json_only_raises_manifest_error(doc: Any) -> None:
    with contextlib.suppress(ManifestError):
        parse_manifest(json.dumps(doc).encode())


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(manifests(), st.data())
def test_garbled_manifests_only_raise_manifest_error(m: Manifest, data: st.DataObject) -> None:
    """Replace, delete or retype any one part of a valid manifest: the parser either
    accepts something consistent or raises ManifestError, never anything else."""
    doc = json.loads(m.to_json())
    path = data.draw(st.sampled_from(_paths(doc)[1:]))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    action = data.draw(st.sampled_from(["replace", "delete", "nudge"]))
    if action == "delete":
        del parent[path[-1]]
    elif action == "nudge" and isinstance(parent[path[-1]], int):
        parent[path[-1]] += data.draw(st.sampled_from([-1, 1, 2**40, -(2**40)]))
    else:
        parent[path[-1]] = data.draw(json_values)
    try:
        parsed = parse_manifest(json.dumps(doc).encode())
    except ManifestError:
        return
    for t in parsed.tensors.values():  # whatever was accepted adds up
        assert sum(s.nbytes for s in t.slices) == t.nbytes
        for s in t.slices:
            assert "/" not in s.file and s.file not in (".", "..")


def test_deeply_nested_json() -> None:
    with contextlib.suppress(ManifestError):
        parse_manifest(b"[" * 100_000 + b"]" * 100_000)
