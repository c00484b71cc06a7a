#!/usr/bin/env bash
# The GPU check: the whole test suite on one GPU machine (GPU-marked tests run, CPU-only ones skip), then the
# kernels' compiled-vs-reference checks. Logs and a summary go to $OUT (default ./gpu_check_out).
#
#   bash tools/gpu_check.sh            # tests + kernel checks
#   bash tools/gpu_check.sh tests      # tests only
#   bash tools/gpu_check.sh checks     # kernel checks only
#   GPU_CHECK_TESTS="tests/engine tests/pallas_kernels" bash tools/gpu_check.sh tests   # a part of the suite
#
# On one H200 (16 cores) the suite runs in 8 workers sharing the GPU (5 on an H100: see `workers` below): JAX
# allocates GPU memory as it needs it instead of preallocating 75% per process, XLA's compilations go to a
# persistent cache, and torch (CPU, for the parity references) keeps to two threads per worker. The server's tests
# need packages the machine lacks: carry .whl (made here by tools/gpu_wheels.sh) in the call, or tests/serve skips.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false OMP_NUM_THREADS=2
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxmodels-jax-cache}
# Workers share the card's memory with nothing reserved, so their number follows its size: 8 on an H200 (141 GB),
# 5 on an H100 (80 GB), where 8 ran three compiled-kernel tests out of memory beside the long-context engine tests
# (2026-12-05; each passed alone).
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -cd 0-9)
default_workers=$(( ${gpu_mib:-0} / 15360 )); (( default_workers > 8 )) && default_workers=8
(( default_workers < 1 )) && default_workers=8  # no nvidia-smi: the suite's CPU half, as before
workers=${GPU_CHECK_WORKERS:-$default_workers}
bash tools/install_wheels.sh  # the server's packages, where .whl/ was carried (tools/gpu_wheels.sh)

start=$SECONDS
tests_status=0
if [ "${1:-all}" != "checks" ]; then
    # shellcheck disable=SC2086  # the test paths are words
    # -v: a line per test as it ends, so that a call cut off at its time limit still names its failures.
    python3 -m pytest -v -rfE -n "$workers" -p no:cacheprovider --durations=15 ${GPU_CHECK_TESTS:-tests/} 2>&1 \
        | tee "$OUT/gpu_tests.log"
    tests_status=${PIPESTATUS[0]}
    tests="exit $tests_status in $((SECONDS - start)) s: $(tail -1 "$OUT/gpu_tests.log")"
    # The workers' memory pools keep what each has taken (JAX's allocator gives nothing back), so a test late in the
    # run can find the card full: on an H100 with 5 workers one compiled-kernel test failed so on 2026-12-05 and
    # passed alone. Where a failure was the GPU's memory running out, the failed tests run again, one process alone,
    # and the summary gives both runs.
    if [ "$tests_status" != 0 ] && grep -q "RESOURCE_EXHAUSTED\|CUDA_ERROR_OUT_OF_MEMORY" "$OUT/gpu_tests.log"; then
        mapfile -t failed < <(grep "^FAILED " "$OUT/gpu_tests.log" | sed 's/^FAILED \([^ ]*\).*/\1/' | sort -u)
        if [ "${#failed[@]}" -gt 0 ]; then
            python3 -m pytest -v -rfE -p no:cacheprovider "${failed[@]}" 2>&1 | tee "$OUT/gpu_tests_rerun.log"
            tests_status=${PIPESTATUS[0]}
            tests="$tests; out of memory, ${#failed[@]} failed run again alone: exit $tests_status:"\
" $(tail -1 "$OUT/gpu_tests_rerun.log")"
        fi
    fi
else
    tests="not run (checks only)"
fi

checks_status=0
checks="not run (tests only)"
if [ "${1:-all}" != "tests" ]; then
    python3 bench/attention_kernels.py --check --log "$OUT/attention_kernels.log" || checks_status=1
    python3 bench/mamba_kernels.py --check --quick --kernels pooled,decode --out "$OUT" || checks_status=1
    python3 bench/dsa_kernels.py --check --quick --only select,mla,gmm --log "$OUT/dsa_kernels.log" || checks_status=1
    checks="exit $checks_status"
fi

{
    echo "gpu check $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1),"\
         "jax $(python3 -c 'import jax; print(jax.__version__)')"
    echo "tests: $tests"
    echo "kernel checks: $checks"
} | tee "$OUT/summary.txt"
exit $((tests_status || checks_status))
