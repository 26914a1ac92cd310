"""Each recovery strategy's goodput at published failure rates, by simulation.

    python bench/plan_scenarios.py            # 3 seeds per candidate interval
    python bench/plan_scenarios.py --seeds 1  # quicker

Scenarios (docs/simulator.md gives the sources and the assumed costs):

- ``llama3``: Meta's Llama 3 405B pre-training, 16,384 GPUs, 419 unexpected
  interruptions in 54 days (job MTBF 3.09 h); 54 days simulated.
- ``llama3_spares``: the same with 16 hot-spare nodes (one replica's worth).
- ``rsc_1k`` / ``rsc_16k``: Meta's RSC clusters, job mean time to failure
  7.9 h at 1,024 GPUs and 1.8 h at 16,384 GPUs.
- ``gpus_100k``: 100,000 GPUs at Llama 3's per-node failure rate (job MTBF ~31 min).

Every scenario: 8 GPUs a node, a replica of 16 nodes (tensor x pipeline
parallel 128 GPUs, as Llama 3), 10 s steps, a 10 s save stall and 60 s write,
120 s restore, 30 s detection, 10 s rebuild, 5 s join, replacement 600 s (cv
0.5), full restart 300 s. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

from planaria.sim import SimParams
from planaria.sim.search import plan

COMMON = dict(gpus_per_node=8, nodes_per_replica=16, step_s=10.0, ckpt_stall_s=10.0,
              ckpt_write_s=60.0, restore_s=120.0, detect_s=30.0, rebuild_s=10.0,
              join_stall_s=5.0, replacement_s=600.0, replacement_cv=0.5, restart_s=300.0)


def job_mtbf(nodes: int, hours: float) -> float:
    """The node MTBF that gives a job of ``nodes`` nodes this MTBF."""
    return hours * nodes


LLAMA3_NODE_MTBF_H = job_mtbf(2048, 54 * 24 / 419)

SCENARIOS: dict[str, SimParams] = {
    "llama3": SimParams(nodes=2048, node_mtbf_h=LLAMA3_NODE_MTBF_H, days=54, **COMMON),
    "llama3_spares": SimParams(nodes=2048, node_mtbf_h=LLAMA3_NODE_MTBF_H, days=54, spares=16,
                               spare_swap_s=60.0, **COMMON),
    "rsc_1k": SimParams(nodes=128, node_mtbf_h=job_mtbf(128, 7.9), days=30, **COMMON),
    "rsc_16k": SimParams(nodes=2048, node_mtbf_h=job_mtbf(2048, 1.8), days=30, **COMMON),
    "gpus_100k": SimParams(nodes=12_496, node_mtbf_h=LLAMA3_NODE_MTBF_H, days=30, **COMMON),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    out: dict[str, dict] = {}
    for name, params in SCENARIOS.items():
        t0 = time.perf_counter()
        result = plan(params, seeds=tuple(range(args.seeds)))
        rows = result.to_json()
        print(f"{name}: {params.gpus:,} GPUs, job MTBF {params.job_mtbf_s / 3600:.2f} h, "
              f"{params.days:g} days ({time.perf_counter() - t0:.1f} s to plan)")
        for s, sp in rows["strategies"].items():
            print(f"  {s:8s} goodput {100 * sp['goodput']:5.1f}%  save every "
                  f"{sp['interval_s'] / 60:7.1f} min  failures {sp['failures']:.0f}")
        print(f"  recommended: {rows['recommended']}")
        out[name] = {"gpus": params.gpus, "job_mtbf_h": params.job_mtbf_s / 3600,
                     "days": params.days, "spares": params.spares,
                     "daly_interval_s": rows["daly_interval_s"],
                     "strategies": {s: {"goodput": round(sp["goodput"], 4),
                                        "interval_s": sp["interval_s"]}
                                    for s, sp in rows["strategies"].items()},
                     "recommended": rows["recommended"]}
    print(json.dumps({"bench": "plan_scenarios", "seeds": args.seeds, "scenarios": out}))


if __name__ == "__main__":
    main()
