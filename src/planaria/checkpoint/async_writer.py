"""A worker's checkpoint writer: snapshot now, write in the background, one save at a time."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from planaria.checkpoint.backoff import with_retries
from planaria.checkpoint.fence import CopyFence
from planaria.checkpoint.plan import ShardPlan
from planaria.checkpoint.staging import ShardImage, slice_of
from planaria.checkpoint.writer import (
    ShardRecord,
    remove_shard,
    write_description,
    write_image,
    write_record,
    write_shard,
)

__all__ = ["AsyncShardWriter", "background_priority"]

_log = logging.getLogger("planaria.checkpoint")


def background_priority() -> None:
    """Puts the calling thread in ``SCHED_IDLE`` (Linux; elsewhere the lowest nice value):
    it runs on CPU time that training leaves idle (waits in collectives, step
    boundaries) instead of taking it from training. An unprivileged thread may always
    lower its own priority; where even that fails the thread just keeps its own."""
    try:
        if hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        else:  # pragma: no cover - not Linux
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError as err:  # pragma: no cover - a sandbox that forbids it
        _log.debug("could not lower the writer thread's priority: %r", err)


def _live_share(tensors: Mapping[str, torch.Tensor], plan: ShardPlan) -> dict[str, torch.Tensor]:
    """The plan's slices as views of the live tensors (no copy for contiguous CPU tensors)."""
    return {spec.key: slice_of(tensors, spec) for spec in plan.slices}


class AsyncShardWriter:
    """Owns a writer's staging buffers and background thread.

    :meth:`start` blocks only for the snapshot (the share copied into a reused
    :class:`ShardImage` of the shard file), then :func:`write_image` runs on a
    background thread (``O_DIRECT`` on local disk unless ``direct=False``). Given a
    :class:`~planaria.checkpoint.fence.CopyFence`, :meth:`start` does not wait even for
    the copy: a staging thread (at normal priority: the next update waits for it) copies
    while the caller goes on, the fence closed meanwhile. Saves never overlap: a new
    :meth:`start` first waits for the previous write (a caller that must not wait looks
    at :attr:`busy` first). Not thread-safe: one owner calls it.
    """

    def __init__(
        self,
        root: str,
        *,
        busy_timeout_s: float | None = None,
        fsync: bool = True,
        pin_memory: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        verify: bool = True,
        attempts: int = 3,
        staging_budget_bytes: int | None = None,
        direct: bool = True,
        before_write: Callable[[int], None] | None = None,
        before_copy: Callable[[int], None] | None = None,
    ) -> None:
        """``busy_timeout_s``: the longest :meth:`start` waits for the previous write (None:
        no limit), then ``TimeoutError``; ``verify``: read each shard back once written and
        check it; ``attempts``: writes tried (with backoff) before a storage error is final
        (:class:`~planaria.faults.errors.StorageError`); ``staging_budget_bytes``: the most host
        memory the staging buffers may hold (None: a share's size, about 1/N of the
        state); a share over it is written at once from the live tensors, without a
        copy, blocking :meth:`start` for the whole write; ``before_write(step)``: called on the
        writing thread as each save's write begins (a fault point)."""
        self.root = root
        self.busy_timeout_s = busy_timeout_s
        self.fsync = fsync
        self.storage_options = dict(storage_options or {})
        self.verify = verify
        self.attempts = attempts
        self.staging_budget_bytes = staging_budget_bytes
        self.direct = direct
        self.before_write = before_write
        self.before_copy = before_copy
        self.image = ShardImage(pin_memory=pin_memory)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planaria-ckpt",
                                        initializer=background_priority)
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planaria-stage")
        self._future: Future[ShardRecord] | None = None
        self._collected = True
        #: Seconds the last :meth:`start` blocked for its snapshot.
        self.last_stall_s: float | None = None
        #: The last save's copy ran on the staging thread, beside the caller.
        self.copied_beside = False
        #: Seconds the last save's copy into staging took (beside the caller or not).
        self.last_copy_s: float | None = None
        #: Seconds the last completed write took (snapshot excluded).
        self.last_write_s: float | None = None
        #: When (Unix time) the last completed write and its read-back ended.
        self.last_written_t: float | None = None

    @property
    def busy(self) -> bool:
        """True while a background write is running."""
        return self._future is not None and not self._future.done()

    def start(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        plan: ShardPlan,
        *,
        save_id: str | None = None,
        describe: dict[str, Any] | None = None,
        fence: CopyFence | None = None,
    ) -> float:
        """Snapshots this writer's share of ``tensors`` for ``step`` and starts writing it
        (after ``describe``, the save's description, if given: see
        :mod:`planaria.checkpoint.finished`).

        With ``fence``, and a share of host tensors that fits the staging budget, the copy
        runs on the staging thread with ``fence`` closed, and this returns at once: the
        caller must keep the tensors unchanged until the fence opens (every writer of
        them waits at it). Device tensors are copied here (a copy from a device on another
        thread would need a stream of its own, not written yet).

        Returns the seconds the snapshot blocked. An outcome of the previous save not
        collected with :meth:`result` is logged and dropped.
        """
        if self.busy:
            assert self._future is not None
            try:
                self._future.exception(timeout=self.busy_timeout_s)
            except FutureTimeout:
                raise TimeoutError(
                    f"previous checkpoint write still running after {self.busy_timeout_s} s"
                ) from None
        if self._future is not None and not self._collected:
            err = self._future.exception()
            if err is not None:
                _log.warning("dropping uncollected failure of the previous save: %r", err)
        t0 = time.perf_counter()
        over_budget = (self.staging_budget_bytes is not None
                       and plan.nbytes > self.staging_budget_bytes)
        self.copied_beside = (fence is not None and not over_budget
                              and all(slice_of(tensors, spec).device.type == "cpu"
                                      for spec in plan.slices))
        if self.copied_beside:
            assert fence is not None
            fence.close()
            self._future = Future()
            self._stager.submit(self._stage_then_write, step, tensors, plan, save_id, describe,
                                fence, self._future)
        elif over_budget:
            self.image.clear()
            done: Future[ShardRecord] = Future()
            try:
                done.set_result(self._write(step, plan, _live_share(tensors, plan), save_id,
                                            describe))
            except Exception as err:
                done.set_exception(err)
            self._future = done
        else:
            if self.before_copy is not None:
                self.before_copy(step)
            self.image.fill(tensors, plan, step)
            self.last_copy_s = time.perf_counter() - t0
            self._future = self._pool.submit(self._write, step, plan, None, save_id, describe)
        self.last_stall_s = time.perf_counter() - t0
        self._collected = False
        return self.last_stall_s

    def _stage_then_write(
        self, step: int, tensors: Mapping[str, torch.Tensor], plan: ShardPlan,
        save_id: str | None, describe: dict[str, Any] | None, fence: CopyFence,
        done: Future[ShardRecord],
    ) -> None:
        """The staging thread: the copy (fence closed), then the write on the writer's
        thread, whose outcome becomes ``done``'s."""
        try:
            try:
                fence.wait_go()
                if self.before_copy is not None:
                    self.before_copy(step)
                self.image.fill(tensors, plan, step)
            finally:
                fence.open()
            self.last_copy_s = fence.copy_s
            write = self._pool.submit(self._write, step, plan, None, save_id, describe)
        except BaseException as err:
            done.set_exception(err)
            return

        def settle(w: Future[ShardRecord]) -> None:
            err = w.exception()
            if err is not None:
                done.set_exception(err)
            else:
                done.set_result(w.result())

        write.add_done_callback(settle)

    def _write(
        self, step: int, plan: ShardPlan, share: dict[str, torch.Tensor] | None,
        save_id: str | None, describe: dict[str, Any] | None = None,
    ) -> ShardRecord:
        """Writes ``share`` (live views, over the staging budget) or else the staged image;
        first ``describe`` beside it, after it the shard's record."""
        if self.before_write is not None:
            self.before_write(step)
        t0 = time.perf_counter()
        if describe is not None:
            with_retries(
                lambda: write_description(self.root, step, save_id, describe,
                                          storage_options=self.storage_options,
                                          fsync=self.fsync),
                what=f"writing the description of the save of step {step}",
                attempts=self.attempts,
            )

        def attempt() -> ShardRecord:
            if share is not None:
                return write_shard(self.root, step, plan.index, plan.num_shards, share,
                                   save_id=save_id, fsync=self.fsync, verify=self.verify,
                                   storage_options=self.storage_options)
            return write_image(self.root, step, plan.index, plan.num_shards, self.image,
                               save_id=save_id, fsync=self.fsync, verify=self.verify,
                               storage_options=self.storage_options, direct=self.direct)

        try:
            record = with_retries(
                attempt,
                what=f"writing shard {plan.index} of step {step}", attempts=self.attempts,
            )
        except BaseException:
            remove_shard(self.root, step, plan.index, plan.num_shards, save_id,
                         storage_options=self.storage_options)  # no partial file stays
            raise
        written_t = time.time()
        with_retries(
            lambda: write_record(self.root, record, written_t=written_t,
                                 storage_options=self.storage_options, fsync=self.fsync),
            what=f"writing the record of shard {plan.index} of step {step}",
            attempts=self.attempts,
        )
        self.last_write_s = time.perf_counter() - t0
        self.last_written_t = written_t
        return record

    def poll(self) -> ShardRecord | None:
        """The record of the last save if it has finished, None while it runs (or if there
        is none); re-raises its error if it failed."""
        if self._future is None or not self._future.done():
            return None
        return self.result(0)

    def result(self, timeout_s: float | None = None) -> ShardRecord:
        """Waits up to ``timeout_s`` for the last save; returns its record or raises its
        error. ``TimeoutError`` if it is still running; ``RuntimeError`` if none started."""
        if self._future is None:
            raise RuntimeError("no checkpoint save was started")
        try:
            record = self._future.result(timeout=timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"checkpoint write still running after {timeout_s} s") from None
        finally:
            if self._future.done():
                self._collected = True
        return record

    def close(self, timeout_s: float | None = None) -> None:
        """Waits up to ``timeout_s`` for a running write, then frees the buffers and thread."""
        if self._future is not None:
            try:
                self._future.exception(timeout=timeout_s)
            except FutureTimeout:
                _log.warning("closing with a checkpoint write still running")
        self._pool.shutdown(wait=False)
        self._stager.shutdown(wait=False)
        self.image.clear()
