#!/usr/bin/env bash
# The GPU checks in one go, on a machine with a CUDA device and planaria's requirements:
# the GPU tests (tests/worker/test_gpu.py; elsewhere they skip with the reason), a smoke run of
# the GPU bench, then the bench itself (bench/gpu.py: step time against DDP on the same
# GPU, recovery from a kill). Logs go to $GPU_CHECK_OUT (default: ./gpu_check_out); the
# last line printed is one JSON object with every figure.
#
#     bash bench/gpu_check.sh            # everything (about 8 minutes on one H200)
#     bash bench/gpu_check.sh --quick    # the tests and the smoke run only
#
# On a copy of the tree without git (another machine), set PLANARIA_COMMIT to the commit it
# holds: the records name it.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${GPU_CHECK_OUT:-gpu_check_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 - <<'PY'
import torch
assert torch.cuda.is_available(), "bench/gpu_check.sh needs a CUDA device: none is visible"
print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
PY
[ $? -eq 0 ] || exit 1
python3 -c 'import torch; print(f"device: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")' \
    > "$out/gpu_tests.log"

python3 -m pytest -q -p no:cacheprovider -m gpu tests/worker/test_gpu.py -rs --durations=0 \
    2>&1 | tee -a "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
summary=$(tail -n 1 "$out/gpu_tests.log")
# The tests' summary as one JSON line, for make_benchmarks_md.py --ingest gpu_tests=...
python3 bench/gpu_tests_summary.py "$out/gpu_tests.log" > "$out/gpu_tests.json"

python3 bench/gpu.py --quick 2>&1 | tee "$out/gpu_quick.log"
quick_rc=${PIPESTATUS[0]}
bench_json=null
if [ "${1:-}" != "--quick" ]; then
    python3 bench/gpu.py 2>&1 | tee "$out/gpu_bench.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] && bench_json=$(tail -n 1 "$out/gpu_bench.log")
fi
python3 - "$tests_rc" "$quick_rc" "$summary" "$bench_json" <<'PY'
import json, sys
tests_rc, quick_rc, summary, bench = sys.argv[1:5]
print(json.dumps({"bench": "gpu_check", "tests_rc": int(tests_rc), "tests": summary.strip("= "),
                  "quick_rc": int(quick_rc), "gpu": json.loads(bench)}))
PY
