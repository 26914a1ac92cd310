"""The controller in parts: one per concern, joined by small Protocols (:mod:`.protocols`).

:class:`~planaria.control.job.Job` is a facade over them: :mod:`.membership` (generations,
fencing, who holds the state), :mod:`.calls` (starting, waiting on and judging worker
calls), :mod:`.commit_log` (the only writer of ``steps_done`` and the ledger),
:mod:`.boundary` (where a run must end, and what happens at a step boundary),
:mod:`.notices` (preemption notices), :mod:`.hooks` (the fault hook seam),
:mod:`.replicas` (replica checksums), :mod:`.runtime` (Ray, the store, the pool) and
:mod:`.wiring` (which part receives which seam).
"""

__all__: list[str] = []
