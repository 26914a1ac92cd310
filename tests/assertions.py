"""Assertions shared by the fault tests: exactly-once data and equal final state."""

from __future__ import annotations

import os
from typing import Any


def assert_exactly_once(
    run_dir: os.PathLike[str] | str,
    *,
    num_samples: int,
    global_batch_size: int,
    steps: int,
    seed: int = 0,
    dataset: Any = None,
) -> None:
    """Each committed step was served its planned batch; every sample once per epoch
    (trained once, or consumed by a step skipped on purpose, which the ledger reads apart).

    Reads what the workers' datasets served (the ledger's ``served`` records of
    the attempt that committed each step, not the ids the controller sent).
    With ``dataset`` (the reference dataset), every served sample's content
    digest must match that dataset's sample of the same id.
    """
    from collections import Counter
    from pathlib import Path

    from planaria.data.integrity import sample_digest
    from planaria.data.plan import DataPlan, Ledger

    records = Ledger.committed_records(Path(run_dir))
    skipped = Ledger.skipped_records(Path(run_dir))  # served, consumed, not trained
    assert not set(records) & set(skipped)
    assert sorted({**records, **skipped}) == list(range(steps)), (
        f"steps in ledger: trained {sorted(records)}, skipped {sorted(skipped)}")
    plan = DataPlan(num_samples, global_batch_size, seed=seed)
    left_out = Ledger.skipped_samples(Path(run_dir))  # a work fault's samples, skipped on purpose
    stream: list[int] = []
    for step in range(steps):
        served = records[step] if step in records else skipped[step]
        assert served, f"step {step} was committed with no served record"
        ids = [int(i) for r in served for i in r["ids"]]
        planned = [i for i in plan.batch(step).tolist()
                   if not (i in left_out and left_out[i] <= step)]
        assert sorted(ids) == sorted(planned), (
            f"step {step} was served other samples than its plan"
        )
        if dataset is not None:
            for r in served:
                digests = r.get("digests")
                assert digests and len(digests) == len(r["ids"]), f"step {step}: no digests"
                for i, d in zip(r["ids"], digests, strict=True):
                    assert d == sample_digest(dataset[i]), (
                        f"step {step}: {r['worker']} was served other content for sample {i}"
                    )
        # Served, and skipped on purpose: together, every sample once per epoch.
        stream += ids + [i for i in plan.batch(step).tolist() if i not in planned]
    full_epochs = len(stream) // num_samples
    for epoch in range(full_epochs):
        counts = Counter(stream[epoch * num_samples : (epoch + 1) * num_samples])
        assert len(counts) == num_samples and set(counts.values()) == {1}
    tail = Counter(stream[full_epochs * num_samples :])
    assert not tail or set(tail.values()) == {1}


def assert_same_state(a: dict, b: dict, *, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(
            a[key], b[key], atol=atol, rtol=rtol, msg=lambda m, k=key: f"{k}: {m}"
        )


def events(run_dir: os.PathLike[str] | str) -> list[dict]:
    """The run's event records (a torn last line from a crash is left out)."""
    import json
    from pathlib import Path

    lines = (Path(run_dir) / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


def of(evs: list[dict], name: str) -> list[dict]:
    """The records of one event type, in order."""
    return [e for e in evs if e["event"] == name]


def behind(evs: list[dict]) -> set[str]:
    """The survivors that were a step behind when a run of steps failed: they receive the
    state like joiners (``control/run_ahead.py``). Which survivor lags at a kill is timing,
    not behaviour: tests about joiners leave them out."""
    return {w for e in of(evs, "run_ahead") if e.get("ended") == "failed"
            for w in e.get("behind", [])}


def joiners_only(records: list[dict], evs: list[dict], key: str = "worker") -> list[dict]:
    """``records`` (``state_received`` by ``worker``, ``state_transfer`` by ``dst``) less
    those of survivors that were behind."""
    lagged = behind(evs)
    def mine(r: dict) -> bool:
        names = r[key] if isinstance(r[key], list) else [r[key]]
        return not set(names) <= lagged
    return [r for r in records if mine(r)]


def transfer_to(evs: list[dict], joiner: str) -> dict:
    """The one state transfer to ``joiner``; any other went to a survivor that was behind."""
    transfers = of(evs, "state_transfer")
    lagged = behind(evs)
    mine = [t for t in transfers if t["dst"] == [joiner]]
    assert len(mine) == 1, f"{joiner} received the state {len(mine)} times: {transfers}"
    others = {w for t in transfers if t is not mine[0] for w in t["dst"]}
    assert others <= lagged, f"state sent to {others - lagged}, neither {joiner} nor behind"
    return mine[0]


def drive(job: Any, steps: int, *, wait_width_at: int | None = None, width: int = 3,
          before: Any = None) -> None:
    """``fit()``'s loop on an open job, one step at a time (``train_step``: runs of one step):
    train until ``steps`` steps are committed, recovering from every failure. At
    ``wait_width_at`` steps done it first waits (bounded) for ``width`` replicas, so that a
    slow replacement start cannot end the run before it joins; ``before(job)`` runs before
    every step attempt."""
    import planaria

    while job.steps_done < steps:
        try:
            if wait_width_at is not None and job.steps_done == wait_width_at:
                job.wait_for_width(width, timeout_s=180)
            if before is not None:
                before(job)
            job.train_step()
        except planaria.Failure as failure:
            job.recovery.handle(failure)


def run_to(job: Any, steps: int) -> dict:
    """``fit()``'s loop on an open job, in runs up to the next boundary: train until
    ``steps`` steps are committed, recovering from every failure; returns the final model
    state."""
    import planaria

    while job.steps_done < steps:
        try:
            job.run_steps(steps)
        except planaria.Failure as failure:
            job.recovery.handle(failure)
    return job.model_state_dict()


def run_with_evals(job: Any, steps: int) -> None:
    """fit()'s loop on an open job, the last evaluation included, recovering from every
    failure (one during an evaluation too: it runs again over the new width)."""
    import planaria

    while job.steps_done < steps or job.evaluation.due():
        try:
            if job.steps_done < steps:
                job.run_steps(steps)
            else:
                job.evaluation.if_due()
        except planaria.Failure as failure:
            job.recovery.handle(failure)


def assert_the_reference_training(state: dict, reference: Any, steps: int) -> None:
    """``state`` equals ``reference(steps)`` (a training outside planaria on the same batches),
    key for key within ``assert_close``, and the comparison can see one step's difference
    (``reference(steps - 1)`` differs)."""
    import torch

    expected = reference(steps)
    assert state.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(state[key], expected[key], msg=key)
    one_step_short = reference(steps - 1)
    assert any(not torch.allclose(one_step_short[k], expected[k]) for k in expected)


def assert_one_kill_healed_by_a_transfer(evs: list[dict]) -> None:
    """The run had one fault, a lost worker, and its replacement received the state."""
    assert [f["kind"] for f in of(evs, "fault")] == ["worker_lost"]
    assert of(evs, "state_transfer"), "the replacement received no state"
