"""A replica's training state: model, optimizer, scheduler, module buffers, loss scaler.

Built from the spec's factories, each run with every global generator seeded from
(spec seed, factory), so every replica builds the same state (invariant 8). In a
sharded replica (``workers_per_replica`` > 1) the model is sharded over the
replica's workers with FSDP2 (:mod:`planaria.worker.sharded`). The gradient's reducer
(:mod:`planaria.worker.reduce`) is built with the model: it owns the gradients.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from planaria.checkpoint.fence import CopyFence
from planaria.config import TrainSpec
from planaria.data.randomness import factory_seed, seed_globals
from planaria.faults.errors import ConfigError, PlanariaError, UserCodeError
from planaria.faults.user_code import user_call
from planaria.worker.buffers import BufferSync
from planaria.worker.reduce import FlatGradients, FlatReducer, Reducer
from planaria.worker.reduce_overlapped import OverlappedReducer
from planaria.worker.reduce_sharded import ShardedReducer
from planaria.worker.sharded import init_replica_group, shard_model
from planaria.worker.skip_init import initialisation_skipped, zero_parameters
from planaria.worker.state import flatten_state, jsonable, model_checksum

__all__ = ["ReplicaShape", "ReplicaState", "check_optimizer", "refuse_unsharded_state",
           "run_factory"]

T = TypeVar("T")


def run_factory(what: str, seed: int, fn: Callable[..., T], *args: Any) -> T:
    """A user factory, run with every global generator seeded from (spec seed, factory)."""
    seed_globals(factory_seed(seed, what))
    return user_call(f"the {what} factory", fn, *args)


def refuse_unsharded_state(model: torch.nn.Module, k: int) -> None:
    """ConfigError for a model with state beside its parameters and buffers (a module's
    ``get_extra_state``), which sharded replicas do not keep: a planaria limitation, said
    as one. Buffers (BatchNorm's running statistics) stay whole on each worker and are kept
    in step (:mod:`planaria.worker.buffers`); a tied weight (a language model's head sharing
    its embedding's matrix) is a parameter under a second name: it shards."""
    known = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    known |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    other = [name for name in model.state_dict() if name not in known]
    if other:
        shown = ", ".join(other[:4]) + (f" and {len(other) - 4} more" if len(other) > 4 else "")
        raise ConfigError(
            f"workers_per_replica={k} is not valid with this model: it has state beside its "
            f"parameters and buffers ({shown}: a module's get_extra_state). Sharded "
            "replicas do not support that yet (a planaria limitation, not an error in your "
            "model): they would neither keep it equal across the replica's workers nor save "
            "it in checkpoints or send it to joining replicas. Use workers_per_replica=1"
        )


@dataclass(frozen=True, kw_only=True)
class ReplicaShape:
    """Where this worker sits in its replica and how its gradient is reduced."""

    k: int
    """The replica's workers (more than one: a sharded replica)."""
    shard_index: int
    """This worker's place among them."""
    replica_key: str
    """The replica's name in the store (its inner group's prefix)."""
    backend: str
    """The process groups' backend (gloo, nccl)."""
    timeout_s: float
    """The replica's inner group's collective timeout."""
    overlap_reduction: bool
    """The gradient is reduced during the last backward (OverlappedReducer)."""
    keep_finished: bool = True
    """A failed step's finished micro-batches are kept (planaria.worker.kept_work)."""


def check_optimizer(optimizer: Any, model: torch.nn.Module, gets: str) -> None:
    """Raises UserCodeError unless ``optimizer`` is an optimizer whose groups hold every
    parameter of ``model`` that requires a gradient, and none of another model."""
    factory = ("optimizer(model)" if gets == "model" else "optimizer(params)")
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g
                                               for g in groups):
        raise UserCodeError(
            f"the optimizer factory returned {type(optimizer).__name__}, not an optimizer: "
            f"{factory} must return a torch.optim.Optimizer (with param_groups), such as "
            "torch.optim.AdamW(...)"
        )
    held = {id(p) for g in groups for p in g["params"]}
    names = {id(p): name for name, p in model.named_parameters()}
    missing = [name for name, p in model.named_parameters()
               if p.requires_grad and id(p) not in held]
    if missing:
        raise UserCodeError(
            f"the optimizer's param_groups miss {len(missing)} of the model's parameters "
            f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): they would get "
            "gradients and never be updated; put every parameter in one group (with "
            "optimizer_gets='model', from model.named_parameters()), or set "
            "requires_grad=False on those to freeze them"
        )
    if any(i not in names for i in held):
        raise UserCodeError(
            "the optimizer holds tensors that are not parameters of the model planaria built: "
            f"{factory} must take the parameters from what it is given (the model on its "
            "device, sharded with workers_per_replica > 1), not from a model of its own"
        )


class ReplicaState:
    """This worker's part of a replica's state; :meth:`build` makes it (again)."""

    def __init__(self, spec: TrainSpec, device: torch.device, shape: ReplicaShape,
                 store: Any) -> None:
        self.spec = spec
        self.device = device
        self.shape = shape
        self.store = store
        self.model: torch.nn.Module
        self.compiled: Any  # the model, or torch.compile's of it (spec.compile)
        self.optimizer: Any
        self.scheduler: Any = None
        self.buffer_sync: BufferSync
        self.scaler: torch.amp.GradScaler | None = None  # fp16's loss scaler
        self.reducer: Reducer  # owns the gradients; built with the model
        self.built = False
        # Guards the committed state against a snapshot taken beside the training thread
        # (planaria.worker.ckpt_save's ckpt_start_beside).
        self.lock = threading.RLock()
        # Closed while a save's copy reads the live state beside the steps: whoever writes
        # the state (an update, a restore, a received state) waits at it first.
        self.copy_fence = CopyFence()
        # Closed while a state sent to a joiner beside the steps reads the live state
        # (planaria.worker.transfer): the update waits at it too.
        self.send_fence = CopyFence()
        # A state received beside the steps, its optimizer's part still arriving (a
        # planaria.worker.transfer.TransferThread): read it only once it ended.
        self.incoming: Any = None
        self.dirty = False
        """A restore wrote into the live state and did not finish: it is not to be used."""

    def build(self, *, skip_init: bool = False) -> None:
        """Model, optimizer and scheduler in their initial state (seeded from the spec); with
        ``skip_init`` (a joiner, whose state is sent to it) the parameters 0 instead of drawn
        (planaria.worker.skip_init)."""
        spec = self.spec
        if skip_init:
            with initialisation_skipped():
                model = run_factory("model", spec.seed, spec.model)
            zero_parameters(model)
        else:
            model = run_factory("model", spec.seed, spec.model)
        self.model = model.to(self.device)
        if self.shape.k > 1:
            self._shard()
        self.optimizer = run_factory("optimizer", spec.seed, spec.optimizer,
                                     self.model if spec.optimizer_gets == "model"
                                     else self.model.parameters())
        check_optimizer(self.optimizer, self.model, spec.optimizer_gets)
        self.scheduler = (
            run_factory("lr_scheduler", spec.seed, spec.lr_scheduler, self.optimizer)
            if spec.lr_scheduler
            else None
        )
        self.buffer_sync = BufferSync(self.model)
        self.scaler = (torch.amp.GradScaler(self.device.type)
                       if spec.precision == "fp16" else None)
        if self.built:
            self.reducer.close()
        self.reducer = self._make_reducer()
        self.built = True
        self.compiled = (torch.compile(self.model, dynamic=False, **(spec.compile_options or {}))
                         if spec.compile else self.model)

    def _make_reducer(self) -> Reducer:
        gbs = self.spec.global_batch_size
        if self.shape.k > 1:  # FSDP2 owns the gradients (sharded DTensors): no flat buffers
            return ShardedReducer(list(self.model.parameters()), self.device)
        grads = FlatGradients([p for p in self.model.parameters() if p.requires_grad],
                              self.device)
        # A failed step's finished part (kept_work): not with fp16's loss scaler.
        keep = self.shape.keep_finished and self.spec.precision != "fp16"
        if self.shape.overlap_reduction:
            return OverlappedReducer(grads, gbs, keep=keep)
        # On gloo (host memory) the out-of-place ring: no copy before the reduction
        return FlatReducer(grads, gbs, keep=keep, out_of_place=self.device.type == "cpu")

    def _shard(self) -> None:
        """Shards the model over the replica's workers (planaria.worker.sharded)."""
        refuse_unsharded_state(self.model, self.shape.k)
        shape = self.shape
        init_replica_group(self.store, shape.replica_key, shape.shard_index, shape.k,
                           shape.backend, shape.timeout_s)
        self.model = shard_model(self.model, shape.k, self.device, self.spec.shard)

    def wait_readers(self) -> None:
        """Returns once nothing reads the live state beside the steps (a save's copy, a
        state sent to a joiner), and no received state still arrives (its outcome left
        aside: what writes the state now overwrites it): call before writing the state."""
        self.copy_fence.wait()
        self.send_fence.wait()
        if self.incoming is not None:
            self.incoming.end_quietly()
            self.incoming = None

    def await_incoming(self) -> None:
        """Returns once a state received beside the steps has all arrived (at once if none
        is arriving); raises the error that ended its receipt."""
        incoming = self.incoming
        if incoming is not None:
            incoming.wait()
            self.incoming = None

    def flatten(self, *, whole: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The state's tensors by name and its JSON metadata (see
        planaria.worker.state.flatten_state), once a state received beside the steps has
        all arrived."""
        self.await_incoming()
        return flatten_state(self.model, self.optimizer, self.scheduler, whole=whole)

    def checksum(self) -> int:
        return model_checksum(self.model)

    def nbytes(self) -> int:
        tensors, _ = self.flatten()
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def copies(self, steps_done: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Host copies of the whole state and its metadata; a sharded replica's workers
        gather the whole tensors, and only shard 0's copy is returned (the others: empty)."""
        tensors, meta = self.flatten(whole=self.shape.k > 1)
        if self.shape.shard_index:
            return {}, {}  # gathered by the leader: only its copy leaves the replica
        return {k: v.detach().cpu().clone() for k, v in tensors.items()}, {
            **meta,
            "steps_done": steps_done,
        }

    def with_extra_state(self, meta: dict[str, Any]) -> dict[str, Any]:
        """``meta`` with the spec's extra state added (``extra_state``), if it has one, and
        fp16's loss scale and its growth tracker."""
        hook = self.spec.extra_state
        if hook is not None:
            meta["extra_state"] = jsonable(user_call("extra_state get", hook[0], self.model,
                                                     self.optimizer), "extra_state")
        if self.scaler is not None:
            meta["grad_scaler"] = self.scaler.state_dict()
        return meta

    def set_extra_state(self, meta: Mapping[str, Any]) -> None:
        """Hands the extra state in ``meta`` (if any) to the spec's setter, and the loss
        scale to the scaler."""
        hook = self.spec.extra_state
        if hook is not None and isinstance(meta.get("extra_state"), dict):
            user_call("extra_state set", hook[1], self.model, self.optimizer, meta["extra_state"])
        if self.scaler is not None and isinstance(meta.get("grad_scaler"), dict):
            self.scaler.load_state_dict(meta["grad_scaler"])

    def refuse_if_dirty(self, name: str, what: str) -> None:
        """Raises if a restore left this replica's state half written."""
        if self.dirty:
            raise PlanariaError(f"{name} cannot {what}: a restore into it did not finish, "
                                "its state is partly overwritten")
