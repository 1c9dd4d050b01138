#!/usr/bin/env bash
# Run opd experiments on a lent GPU machine, side by side, each under a time limit, and pack what each
# wrote into $OUT/NAME.tgz (results.json/md, data.json, commands.txt, plots, and every run's DONE.json
# and metrics.jsonl: enough for `opd results`, and to see how far a run that hit the limit got).
#
# The machine has no network: the wheels opd needs there come from benchmarks/gpu_carry.sh (run it
# here first; carry [".gpu_wheels"]). Every run's --device is auto, so the runs compute on the GPU;
# results.json's machine names it. OPD_COMMIT names the commit the tree was sent at (the copy's .git, if any, may be older).
#
# There (repository root):
#   OPD_COMMIT=<commit> [SEEDS=3] [EXP_ARGS=--quick] bash benchmarks/gpu_experiments.sh LIMIT_S WORKERS NAME [NAME...]
# Here, to try it on the CPU without the wheels: NO_WHEELS=1 OUT=/tmp/try SEEDS=1 EXP_ARGS=--quick bash ...
set -uo pipefail
cd "$(dirname "$0")/.."
limit=$1 workers=$2
shift 2
out=${OUT:-/tmp/gpu_experiments}
exp=${EXP_DIR:-/tmp/gpu_experiments_runs}
mkdir -p "$out" "$exp"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${NO_WHEELS:-}" ]; then
  export PYTHONPATH=/tmp/gpu_site:$PYTHONPATH
  for w in .gpu_wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/gpu_site; done
  python3 -c "import transformers" 2>/dev/null || for w in .gpu_wheels/compat/*.whl; do
    python3 -m zipfile -e "$w" /tmp/gpu_site
  done
fi
(nvidia-smi -L || echo "no GPU") > "$out/machine.txt" 2>&1
for name in "$@"; do
  (
    timeout "$limit" python3 -m opd experiment "$name" --seeds "${SEEDS:-3}" --workers "$workers" --out "$exp" \
      ${EXP_ARGS:-} > "$out/$name.log" 2>&1
    echo "exit status $?" >> "$out/$name.log"
  ) &
done
wait
for name in "$@"; do
  [ -d "$exp/$name" ] || continue
  (cd "$exp/$name" && find . -maxdepth 1 -type f > /tmp/pack.$name \
    && find runs \( -name DONE.json -o -name metrics.jsonl -o -name summary.json \) >> /tmp/pack.$name \
    && tar czf "$out/$name.tgz" -T /tmp/pack.$name)
done
ls -la "$out"
