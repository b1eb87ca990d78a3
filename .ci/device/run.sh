#!/usr/bin/env bash
# On a lent GPU machine: install the wheels of .ci/device/prepare.sh, check every module imports,
# then run bench scenarios one by one, each under its own time limit, the most wanted first.
# Results (results.md/.json and each run's log tail) are copied under $OUT as they finish.
#   bash .ci/device/run.sh [cuda|cpu]     limits: T_DECODE, T_OFFLOAD_MOE, T_CONCURRENCY, T_QUICK (seconds)
set -u
DEV=${1:-cuda}
PY=${PY:-python3}
OUT=${OUT:-/tmp/devout}
mkdir -p "$OUT" /tmp/r
export PYTHONUNBUFFERED=1 SWARMLM_LOG_LEVEL=INFO
start=$(date +%s)
if [ "$DEV" = cuda ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
fi
$PY - <<'PY' 2>&1 | sort | uniq -c | tail -15 | tee "$OUT/imports.txt"
import importlib, pkgutil
for pkg in ["protocol", "swarm", "peer", "client", "bench"]:
    for m in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        try:
            importlib.import_module(m.name)
        except Exception as e:
            print("MISSING", repr(e))
PY
grep -q MISSING "$OUT/imports.txt" && exit 1
# the default model's shapes with random weights, in this (throwaway) machine's cache
$PY .ci/device/random_default.py "$HOME/.cache/swarmlm/models/SmolLM2-135M-Instruct" | tail -1
echo "setup $(( $(date +%s) - start )) s" | tee -a "$OUT/log.txt"
bench() {  # name limit args...
    name=$1; limit=$2; shift 2
    t0=$(date +%s)
    timeout -k 20 "$limit" $PY -m bench --device "$DEV" --out "/tmp/r/$name" "$@" > "/tmp/r/$name.log" 2>&1
    rc=$?
    pkill -9 -f "swarm.cli"; pkill -9 p2pd; sleep 1
    echo "== $name rc=$rc $(( $(date +%s) - t0 )) s: $*" | tee -a "$OUT/log.txt"
    tail -60 "/tmp/r/$name.log" > "$OUT/$name.log"
    cp "/tmp/r/$name/results.md" "$OUT/$name.md" 2>/dev/null
    cp "/tmp/r/$name/results.json" "$OUT/$name.json" 2>/dev/null
}
bench decode "${T_DECODE:-150}" --quick --scenarios decode,prefill
bench offload_moe "${T_OFFLOAD_MOE:-120}" --quick --scenarios offload,moe --configs default
bench concurrency "${T_CONCURRENCY:-150}" --quick --scenarios concurrency
bench quick "${T_QUICK:-200}" --quick
echo "total $(( $(date +%s) - start )) s" | tee -a "$OUT/log.txt"
