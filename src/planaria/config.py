"""What to train (:class:`TrainSpec`) and how to run it (:class:`RunConfig`).

Both are typed keyword-only dataclasses checked at construction: a wrong value
raises :class:`~planaria.faults.errors.ConfigError` (a ``ValueError``) naming the field,
the value and what is accepted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planaria.faults.errors import ConfigError
from planaria.field_docs import document_fields

__all__ = ["SETUP_PRIORITIES", "RunConfig", "TrainSpec", "check", "local_run_dir"]


def check(ok: bool, field_name: str, value: Any, accepted: str) -> None:
    """Raises ConfigError('field=value: accepted') unless ``ok``."""
    if not ok:
        raise ConfigError(f"{field_name}={value!r} is not valid: {accepted}")


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")
_SCHEME_PART = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:$")  # what Path("s3://b/x") keeps: "s3:"


def local_run_dir(value: str | os.PathLike[str]) -> Path:
    """``value`` as a local path; :class:`ConfigError` for a URL (``s3://bucket/run``), which
    a path would silently turn into a local folder ``./s3:/bucket/run``."""
    text = os.fspath(value)
    parts = Path(text).parts
    if _URL.match(text) or (not isinstance(value, str) and parts and _SCHEME_PART.match(parts[0])):
        raise ConfigError(
            f"run_dir={text!r} is not valid: the run directory (event log, ledger) is a local "
            "path (or a mounted shared file system), not a URL; keep it local and put the "
            "checkpoints on the object store: CheckpointConfig(root='s3://bucket/run', "
            "storage_options={...}), on the command line --checkpoint-root s3://bucket/run "
            "(and --checkpoint-storage-option KEY=VALUE)"
        )
    return Path(text)


@document_fields
@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """What to train. Factories run inside the workers, so nothing heavy crosses the wire.

    The gradient of step s is the sum over its global batch divided by its
    size, whatever the number of replicas. Randomness is width-invariant (see
    :mod:`planaria.data.randomness`): every factory runs with Python's, numpy's and
    torch's generators seeded from ``seed``; torch is seeded again before every
    micro-batch from (seed, step, the micro-batch's place in the global batch),
    and each ``dataset[i]`` has a stream of its own from (seed, step, i):
    :func:`planaria.sample_generator`, or the global generators, which are then
    seeded for the call (at the cost of the loader thread: see ``RunConfig.prefetch``).
    """

    model: Callable[[], Any]
    """Builds the ``nn.Module``; called once per worker with the generators seeded from ``seed``."""
    optimizer: Callable[[Any], Any]
    """Builds the optimizer: from the model's parameters (``model.parameters()``), or from the
    model itself with ``optimizer_gets="model"``. Every parameter that requires a gradient
    must be in one of its groups."""
    loss: Callable[[Any, Any], Any] | None = None
    """(model, batch) → scalar loss (mean over the batch), or (loss, dict of float metrics).
    planaria runs its backward. Give this or ``forward_backward``, not both."""
    dataset: Callable[[], Any]
    """Builds the map-style dataset (``__len__`` and ``__getitem__``), the same on every worker:
    it runs with the generators seeded from ``seed``, and workers compare a fingerprint of it.
    A Hugging Face ``datasets.Dataset`` works as it is (its dict rows collate with torch's
    ``default_collate``; ``with_format("torch")`` for tensors). A stream (``IterableDataset``,
    torch's or Hugging Face's) is refused when the job starts (``ConfigError``): exactly-once
    data needs every sample addressable by an index (see :mod:`planaria.data.map_style` for
    the map-style views). ``RunConfig.loader_workers`` decodes samples in processes."""
    global_batch_size: int
    """Samples per step over all replicas; stays fixed when the width changes."""
    micro_batch_size: int
    """Samples per forward/backward. The global batch is global_batch_size / micro_batch_size
    micro-batches; each rank runs whole ones (best balanced when their number is a multiple
    of the width)."""
    forward_backward: Callable[[Any, Any, Callable[..., None]], Any] | None = None
    """The alternative to ``loss`` for a micro-batch that needs more than one backward
    (several losses, a gradient penalty): ``forward_backward(model, batch, backward)`` runs
    its forwards and calls ``backward(tensor, retain_graph=False)`` as often as it likes, then
    returns the loss to log (a float or a scalar tensor; each term a mean over the batch),
    or (loss, dict of float metrics). ``backward`` scales each tensor by the micro-batch's
    share of the global batch (and by fp16's loss scale) before its backward, so the
    reduced gradient stays the global batch's mean; planaria still owns the reduction,
    clipping, the non-finite check and the update. A ``forward_backward`` that never calls
    ``backward`` is an error (``UserCodeError``). Not with ``RunConfig(overlap_reduction=
    True)``, whose reduction starts during the one backward (refused when the job starts).
    With ``workers_per_replica > 1`` (FSDP2 frees a forward's gathered parameters after its
    backward) each backward needs a forward of its own: no ``retain_graph``, no
    ``torch.autograd.grad(..., create_graph=True)`` (a gradient penalty) there."""
    lr_scheduler: Callable[[Any], Any] | None = None
    """Builds the LR scheduler from the optimizer; stepped once per committed step."""
    collate: Callable[[list[Any]], Any] | None = None
    """Turns a list of samples into a batch (default: torch's default_collate)."""
    grad_clip_norm: float | None = None
    """Clip the reduced gradient to this global L2 norm (None: no clipping)."""
    seed: int = 0
    """Seeds the model's initial state, the data order and per-step randomness."""
    name: str = "spec"
    """A label for logs and reports."""
    compile: bool = False
    """Compile the model with ``torch.compile`` (``dynamic=False``) in every worker; workers
    started later get the compile cache of a running one and compile before they join
    (see :mod:`planaria.worker.compile_cache`)."""
    compile_options: dict[str, Any] | None = None
    """Further keyword arguments for ``torch.compile`` (``mode``, ``backend``, ...)."""
    precision: str | None = None
    """Mixed precision for the forward: ``"bf16"`` (autocast to bfloat16), ``"fp16"``
    (autocast to float16 with a ``GradScaler`` whose state is checkpointed and sent to
    joining replicas; an overflowing step is skipped on every replica alike and the scale
    backs off), or None (full precision). Parameters, gradients and optimizer state stay
    in their own dtype."""
    shard: Callable[[Any, Any], Any] | None = None
    """With ``RunConfig(workers_per_replica=k > 1)``: ``shard(model, mesh) -> model`` applies
    FSDP2's ``fully_shard`` over the replica's 1-D ``DeviceMesh`` (to the root last); None:
    every module holding parameters of its own is a unit, then the root (see
    :func:`planaria.worker.sharded.default_shard`)."""
    optimizer_gets: str = "parameters"
    """What ``optimizer`` is called with: ``"parameters"`` (``model.parameters()``, the
    default) or ``"model"`` (the ``nn.Module``, to build parameter groups from
    ``named_parameters()``, such as weight decay 0 for biases and norm weights). The model is
    on its device and, with ``workers_per_replica > 1``, already sharded (FSDP2: its
    parameters are DTensors, their names unchanged)."""
    extra_state: tuple[Callable[[Any, Any], dict[str, Any]],
                       Callable[[Any, Any, dict[str, Any]], None]] | None = None
    """State beyond the model, optimizer and scheduler (a GradScaler's scale, an EMA's
    counters): ``(get, set)`` with ``get(model, optimizer) -> dict`` (JSON-able) and
    ``set(model, optimizer, state)``; saved in checkpoints and sent to joining replicas."""
    eval_dataset: Callable[[], Any] | None = None
    """Builds the map-style evaluation dataset, in every worker as ``dataset`` is (with the
    generators seeded from ``seed``); None: no evaluation. It is cut into batches of
    ``eval_batch_size`` by index, the same at any width, and batch j runs on live replica
    j % width (see ``RunConfig.eval_every`` and ``Job.evaluate``)."""
    evaluate: Callable[[Any, Any], Any] | None = None
    """(model, batch) → a mapping of metric name to the batch's MEAN of that metric (a float
    or a scalar tensor), e.g. ``{"loss": ..., "accuracy": ...}``; run under
    ``model.eval()`` and ``torch.no_grad()`` (and ``precision``'s autocast). The job's figure
    is the sample-weighted mean over the eval set. None: ``{"loss": loss(model, batch)}``
    (with ``loss``'s metrics, if it returns them)."""
    eval_batch_size: int | None = None
    """Samples per evaluation batch (the last batch may be shorter); None: ``micro_batch_size``."""
    eval_collate: Callable[[list[Any]], Any] | None = None
    """Turns a list of eval samples into a batch, when the eval set's samples or batches
    differ from the training's (a validation loader's own ``collate_fn``); None: ``collate``."""

    def __post_init__(self) -> None:
        for name in ("model", "optimizer", "dataset"):
            check(callable(getattr(self, name)), name, getattr(self, name), "a callable")
        for name in ("loss", "forward_backward", "lr_scheduler", "collate", "eval_collate",
                     "shard"):
            value = getattr(self, name)
            check(value is None or callable(value), name, value, "a callable or None")
        check((self.loss is None) != (self.forward_backward is None), "loss", self.loss,
              "exactly one of loss=(model, batch) -> loss and forward_backward=(model, "
              "batch, backward) -> loss: loss when planaria runs the one backward, "
              "forward_backward when your function calls backward itself")
        check(self.optimizer_gets in ("parameters", "model"), "optimizer_gets",
              self.optimizer_gets, "'parameters' (optimizer(model.parameters())) or 'model' "
              "(optimizer(model), for parameter groups by name)")
        check(
            isinstance(self.global_batch_size, int) and self.global_batch_size >= 1,
            "global_batch_size",
            self.global_batch_size,
            "an integer >= 1",
        )
        check(
            isinstance(self.micro_batch_size, int) and self.micro_batch_size >= 1,
            "micro_batch_size",
            self.micro_batch_size,
            "an integer >= 1",
        )
        check(
            self.global_batch_size % self.micro_batch_size == 0,
            "global_batch_size",
            self.global_batch_size,
            f"a multiple of micro_batch_size={self.micro_batch_size}, so the global batch "
            "divides into whole micro-batches",
        )
        check(
            self.grad_clip_norm is None or self.grad_clip_norm > 0,
            "grad_clip_norm",
            self.grad_clip_norm,
            "a positive float or None",
        )
        check(isinstance(self.seed, int), "seed", self.seed, "an integer")
        check(self.eval_dataset is None or callable(self.eval_dataset), "eval_dataset",
              self.eval_dataset, "a callable that builds the map-style eval dataset, or None")
        check(self.evaluate is None or callable(self.evaluate), "evaluate", self.evaluate,
              "a callable (model, batch) -> {metric: the batch's mean}, or None")
        check(self.eval_dataset is None or self.evaluate is not None or self.loss is not None,
              "evaluate", self.evaluate,
              "a callable (model, batch) -> {metric: the batch's mean} when eval_dataset is "
              "given and there is no loss to evaluate by default (forward_backward specs)")
        check(self.eval_batch_size is None
              or (isinstance(self.eval_batch_size, int) and self.eval_batch_size >= 1),
              "eval_batch_size", self.eval_batch_size, "an integer >= 1 or None "
              "(micro_batch_size)")
        check(self.precision in (None, "bf16", "fp16"), "precision", self.precision,
              "None (full precision), 'bf16' or 'fp16'")
        check(
            self.extra_state is None
            or (isinstance(self.extra_state, tuple) and len(self.extra_state) == 2
                and all(callable(f) for f in self.extra_state)),
            "extra_state",
            self.extra_state,
            "None or (get, set): get(model, optimizer) -> dict, set(model, optimizer, dict)",
        )


PLACEMENTS = (None, "spread", "strict_spread", "pack")
SETUP_PRIORITIES = ("worker", "lowest", "idle")
"""``RunConfig.joiner_setup_priority``'s values (see planaria.worker.low_priority)."""


def _default_threads(replicas: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, replicas))


@document_fields
@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How to run a spec: steps, width, where, and the runtime's deadlines."""

    steps: int
    """Train until this many steps are committed (counting steps done before a resume)."""
    replicas: int
    """Target number of worker replicas."""
    run_dir: Path
    """Where the event log, the ledger and (by default) the checkpoints go: a local path or a
    mounted file system; a URL is refused (put checkpoints on an object store with
    ``CheckpointConfig(root="s3://...")``)."""
    address: str | None = None
    """Ray cluster address (``auto``, ``ray://host:10001``); None: the one in ``RAY_ADDRESS``
    if set (as in a RayJob's driver), else a new local Ray (never another one that happens
    to run on this machine)."""
    placement: str | None = None
    """How workers are laid out over the nodes, with a Ray placement group of one bundle per
    worker slot (replicas + spares; ``cpus_per_worker`` CPUs and, with ``use_gpu``, a GPU):
    ``"spread"`` over as many nodes as possible, ``"strict_spread"`` one worker per node,
    ``"pack"`` on as few nodes as possible; None: wherever Ray's scheduler puts them. A lost
    node's bundles are placed again on the nodes left (or, where none has room, on a node
    that joins later) and replacements take them; a worker beyond the slots (a replacement
    started while the one it replaces still runs) is placed by Ray's scheduler."""
    store_host: str | None = None
    """The address of this machine the controller's store listens on and workers connect to;
    None: ``network_interface``'s address if that is set, else 127.0.0.1 when planaria
    started a private one-node Ray, else this node's IP as Ray sees it. The store listens on
    this address only (see planaria.control.network)."""
    network_interface: str | None = None
    """A network interface (``eth0``) that exists on every node: the store listens on its
    address (unless ``store_host`` is set) and the workers' process groups use it
    (``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``); None: gloo takes the address the
    worker's hostname resolves to."""
    workers_per_replica: int = 1
    """Workers per replica: with k > 1 a replica's k workers shard its parameters,
    gradients and optimizer state with FSDP2 (hybrid sharding: data parallel across
    replicas), and the replica is the unit of width, failure and replacement (see
    :mod:`planaria.worker.sharded`); a spare is a whole replica. Checkpoints store the shards as
    rows of the whole tensors (a restore works at any k). Models as they ship run so: tied
    weights (a Hugging Face language model's head) shard as one parameter, and buffers
    (BatchNorm's running statistics), which FSDP2 leaves whole on each worker, are kept
    equal across all the workers as with k=1 (:mod:`planaria.worker.buffers`), saved and
    sent to joiners. Not yet with placement, the GPU, compile, fp16, overlap_reduction or
    a module's ``get_extra_state`` (refused when the job starts)."""
    spares: int = 0
    """Hot spares: standby workers started and warmed ahead of need (imports, model,
    optimizer and its state built) that take a lost worker's place at once, receiving
    the state as a hot-join does; replenished in the background. Each holds a replica's
    memory (and a GPU with ``use_gpu``) while it waits."""
    cpus_per_worker: float = 1.0
    """CPUs Ray reserves for each worker (spares included)."""
    warm_start: bool | None = None
    """Fork workers from a per-node server that has imported torch once (see
    planaria.worker.forkserver): a worker start costs the node ~0.7 CPU-seconds instead of ~2,
    which on a node whose cores are training is time taken from the steps. None (auto): on when the
    Ray cluster has one node, the workers train on the CPU (not yet measured on a GPU) and
    the job's runtime_env installs no Python environment of its own (conda, pip, uv,
    container, py_executable); True: on there too (every node must run the controller's
    Python, at the same path); False: off."""
    share_compile_cache: bool = True
    """With ``spec.compile``: hand a running worker's compile cache to every worker started
    later (and keep it in ``RUN_DIR/compile_cache.tar.gz`` for a resumed job); False: every
    worker compiles from scratch."""
    overlap_reduction: bool = False
    """Start the gradient all-reduce in buckets during the last micro-batch's backward, as
    buckets complete (as DDP does), instead of once after it (see
    planaria.worker.reduce_overlapped)."""
    keep_finished_micro_batches: bool = True
    """When a worker dies during a step, the survivors keep the micro-batches they finished
    and only the rest is computed again (docs/design.md, "Keeping finished micro-batches").
    On gloo it costs nothing a step (the gradient is summed out of place and a failed
    step's own sum is kept where it is); with NCCL each rank copies its gradient just
    before its all-reduce starts (a device-memory pass, into memory allocated once).
    False: a failed step is computed again whole."""
    prefetch: bool | None = None
    """Load the next step's samples in a background thread while this step computes. None
    (auto): only where the node has a core to spare for it (more cores than the planaria
    workers on it use): with none, the loader's Python competes with the compute for the
    same core and slows the step (measured: the tiny bench model's step took 15.6 ms with
    it, 12.7 ms without, on 2 cores with 2 workers). Never for a dataset whose
    ``dataset[i]`` draws from a global generator (torch's, numpy's, ``random``): the
    generators are the process's, so its samples load on the training thread (event
    ``dataset_global_rng``)."""
    loader_workers: int = 0
    """Processes per worker that decode its samples (``dataset[i]`` and the collate), for
    samples that are costly to decode; 0: the worker's own threads load them (see
    ``prefetch``). torch's ``DataLoader`` with persistent workers, forked from the worker
    once its dataset is built (the dataset is not pickled), given the step's micro-batches
    as planaria plans them: each sample keeps its own random stream from (seed, step, i)
    (:func:`planaria.sample_generator`, or the global generators seeded for it) and is
    recorded in the ledger as with 0, so the training is the same bit for bit. The
    next step's samples load while this one computes (unless ``prefetch=False``). The
    processes end with their worker (closed, or within seconds of its death). Each holds a
    copy-on-write copy of the worker's memory."""
    threads_per_worker: int | None = None
    """torch threads per worker; None: the CPUs of this machine split over the replicas."""
    use_gpu: bool = False
    """Workers train on a GPU (``gpus_per_worker`` of one each)."""
    gpus_per_worker: float = 1.0
    """GPUs Ray reserves for each worker with ``use_gpu``: 1 (one device each, the usual), or
    a fraction to let several workers share one device (functional tests on a single GPU;
    NCCL cannot put two ranks on one device, so such workers talk over gloo)."""
    backend: str = "auto"
    """The process group's backend: ``"auto"`` (NCCL with whole GPUs, gloo on the CPU or
    when workers share a GPU), ``"nccl"`` or ``"gloo"``."""
    ledger: bool = False
    """Record what every step's datasets served (ids and content digests) and every commit,
    append-only, in ``RUN_DIR/ledger.jsonl`` (see :mod:`planaria.data.ledger`)."""
    verify_every: int | None = None
    """Compare every replica's parameter checksum every this many committed steps (None:
    never); a replica that disagrees with the majority is a ``ReplicaDivergence`` fault."""
    eval_every: int | None = None
    """Evaluate on ``spec.eval_dataset`` after every this many committed steps (None: never
    on its own; ``Job.evaluate()`` evaluates on demand)."""
    join_timeout_s: float = 60.0
    """Deadline for building a generation's process group."""
    collective_timeout_s: float = 300.0
    """Deadline for one collective (the hang watchdog usually acts much sooner)."""
    min_transfer_bytes_per_s: float = 20e6
    """A state transfer to joiners may take ``collective_timeout_s`` plus one second per this
    many bytes; while its bytes move it is busy, not hung, past that too."""
    state_beside_step: bool = True
    """A joiner's state is sent beside the first step of the generation it joins: the
    survivors stall for the model's bytes only, the optimizer's arrive while every rank
    computes (gloo, unsharded replicas with no fp16 loss scaler or ``extra_state``; else
    the whole state before the step). False: always the whole state before the step."""
    state_by_memory: bool = True
    """A joiner on its source's node reads the state straight out of the source's memory
    (``process_vm_readv``: one copy by the joiner, where the group's loopback socket costs
    two and the CPU the step needs); where the kernel refuses it (another user, a seccomp
    profile without the call) or off the node, over the group. False: always over it."""
    joiner_memory_reserve: bool = True
    """A worker's optimizer state lives in a region of its node's shared memory
    (``/dev/shm``; a joiner's from its setup, another's from its first step), and a worker
    that dies leaves it to the next joiner on the node: memory already resident, not taken
    fresh from the system beside training (see planaria.worker.memory_reserve). False, or
    no room in ``/dev/shm``: ordinary memory."""
    joiner_skips_init: bool = True
    """A joiner's model built without drawing its weights (planaria.worker.skip_init)."""
    joiner_setup_priority: str = "idle"
    """The CPU priority of a joiner's (a replacement's, a spare's) setup: ``"idle"``
    (Linux's SCHED_IDLE), ``"lowest"`` (nice 19) or ``"worker"`` (the worker's own; see
    planaria.worker.low_priority). On cores it shares with training workers a lower one
    takes what their steps leave; on a node of its own it runs at full speed. With
    ``"idle"`` and warm starts, its process's start (Ray's connection, the imports) runs
    under SCHED_IDLE as well, where the process may set its threads back afterwards
    (planaria.worker.forkserver)."""
    drain_poll_s: float | None = 2.0
    """Ask Ray for draining nodes every this many seconds (in the background): the workers
    on a node Ray drains leave at the next step boundary, as after a preemption notice
    (see planaria.control.drain). None: do not ask."""
    ray_init_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``ray.init``, with ``address`` too (a ``runtime_env``
    carrying the user's code to a cluster's workers: ``{"runtime_env": {"working_dir":
    "."}}``; ``planaria run --runtime-env``)."""

    def __post_init__(self) -> None:
        check(
            isinstance(self.steps, int) and self.steps >= 1, "steps", self.steps, "an integer >= 1"
        )
        check(
            isinstance(self.replicas, int) and self.replicas >= 1,
            "replicas",
            self.replicas,
            "an integer >= 1",
        )
        check(
            isinstance(self.workers_per_replica, int) and self.workers_per_replica >= 1,
            "workers_per_replica",
            self.workers_per_replica,
            "an integer >= 1 (the workers that shard one replica's state)",
        )
        if self.workers_per_replica > 1:
            for name, value, ok in (("placement", self.placement, self.placement is None),
                                    ("use_gpu", self.use_gpu, not self.use_gpu),
                                    ("overlap_reduction", self.overlap_reduction,
                                     not self.overlap_reduction)):
                check(ok, name, value, "its default with workers_per_replica > 1: sharded "
                      "replicas do not support it yet")
        check(
            self.warm_start in (None, True, False), "warm_start", self.warm_start,
            "None (auto), True or False",
        )
        check(
            isinstance(self.spares, int) and self.spares >= 0,
            "spares",
            self.spares,
            "an integer >= 0 (standby workers kept warm)",
        )
        check(
            self.placement in PLACEMENTS,
            "placement",
            self.placement,
            "None, 'spread', 'strict_spread' or 'pack'",
        )
        for name in ("store_host", "network_interface"):
            value = getattr(self, name)
            check(
                value is None or (isinstance(value, str) and value.strip() == value != ""),
                name,
                value,
                "None or a non-empty string",
            )
        check(self.cpus_per_worker > 0, "cpus_per_worker", self.cpus_per_worker, "a number > 0")
        check(0 < self.gpus_per_worker <= 1 or float(self.gpus_per_worker).is_integer(),
              "gpus_per_worker", self.gpus_per_worker,
              "a fraction of one GPU (0 < x <= 1) or a whole number of GPUs")
        check(self.backend in ("auto", "nccl", "gloo"), "backend", self.backend,
              "'auto', 'nccl' or 'gloo'")
        check(self.backend != "nccl" or self.use_gpu, "backend", self.backend,
              "'nccl' needs use_gpu=True; on the CPU use 'auto' or 'gloo'")
        check(self.backend != "nccl" or self.gpus_per_worker >= 1, "backend", self.backend,
              f"NCCL cannot put two ranks on one GPU (gpus_per_worker={self.gpus_per_worker}): "
              "give each worker a whole GPU, or use backend='gloo' to share one")
        check(
            isinstance(self.loader_workers, int) and self.loader_workers >= 0,
            "loader_workers",
            self.loader_workers,
            "an integer >= 0 (processes per worker that decode samples; 0: none)",
        )
        check(
            self.joiner_setup_priority in SETUP_PRIORITIES,
            "joiner_setup_priority",
            self.joiner_setup_priority,
            "one of " + ", ".join(repr(p) for p in SETUP_PRIORITIES),
        )
        check(
            self.threads_per_worker is None or self.threads_per_worker >= 1,
            "threads_per_worker",
            self.threads_per_worker,
            "an integer >= 1 or None",
        )
        check(
            self.verify_every is None
            or (isinstance(self.verify_every, int) and self.verify_every >= 1),
            "verify_every",
            self.verify_every,
            "an integer >= 1 (steps between replica checksum comparisons) or None",
        )
        check(
            self.eval_every is None
            or (isinstance(self.eval_every, int) and self.eval_every >= 1),
            "eval_every",
            self.eval_every,
            "an integer >= 1 (committed steps between evaluations) or None",
        )
        for name in ("join_timeout_s", "collective_timeout_s", "min_transfer_bytes_per_s"):
            check(getattr(self, name) > 0, name, getattr(self, name), "a number of seconds > 0")
        check(
            self.drain_poll_s is None
            or (isinstance(self.drain_poll_s, (int, float)) and self.drain_poll_s > 0),
            "drain_poll_s",
            self.drain_poll_s,
            "a number of seconds > 0 between queries for Ray's draining nodes, or None",
        )
        object.__setattr__(self, "run_dir", local_run_dir(self.run_dir))

    @property
    def process_group_backend(self) -> str:
        """The backend workers build their groups with (``backend`` resolved)."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.use_gpu and self.gpus_per_worker >= 1 else "gloo"

    @property
    def threads(self) -> int:
        return self.threads_per_worker or _default_threads(
            self.replicas * self.workers_per_replica
        )
