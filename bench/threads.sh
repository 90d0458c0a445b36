#!/usr/bin/env bash
# Issue 36's thread benchmark: the demo's 2-rank SFT (scripts/demo.sh's config, embedded cluster, FULL_SHARD, tiny
# Qwen2 with the real Qwen tokenizer, GSM8K) with each rank's intra-op threads chosen three ways, in one invocation on
# the same machine, alternating runs:
#   default  OMP_NUM_THREADS unset: ferl gives each rank cores / ranks-on-the-host threads (the new default);
#   omp1     OMP_NUM_THREADS=1, what torchrun sets;
#   all      OMP_NUM_THREADS=<cores>: every rank takes torch's default pool of one thread per core (the old default).
# Each run trains STEPS steps (default 12, no validation, no checkpoint); tokens/s is the median of
# perf/tokens_per_s over the steps after the first (warm-up). Prints each run, then per mode the median of RUNS runs
# (default 3) with min and max, and the ratios default/omp1 (goal >= 1.0) and default/all.
# Needs the release binary and the demo's model and data: run ./scripts/demo.sh once first (or FERL_BIN, DEMO_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
ferl="${FERL_BIN:-${CARGO_TARGET_DIR:-target}/release/ferl}"
demo="${DEMO_DIR:-runs/demo}"
steps="${STEPS:-12}"
runs="${RUNS:-3}"
cores=$(nproc)
[ -x "$ferl" ] || { echo "no $ferl: run ./scripts/demo.sh (or cargo build --release -p ferl) first" >&2; exit 1; }
[ -f "$demo/model/model.safetensors" ] && [ -f "$demo/data/train.parquet" ] ||
  { echo "no demo model/data under $demo: run ./scripts/demo.sh first" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

run_once() { # mode run -> prints the median tokens/s of steps 2..N
  local mode=$1 i=$2 dir="$work/$1-$2"
  local env=(env -u OMP_NUM_THREADS)
  case $mode in
    omp1) env=(env OMP_NUM_THREADS=1) ;;
    all) env=(env OMP_NUM_THREADS="$cores") ;;
  esac
  "${env[@]}" "$ferl" sft --nproc-per-node 2 --config examples/configs/gsm8k_tiny.yaml \
    data.train_files="$demo/data/train.parquet" data.val_files=[] model.partial_pretrain="$demo/model" \
    trainer.default_local_dir="$dir" trainer.total_training_steps="$steps" trainer.save_freq=-1 \
    trainer.test_freq=-1 trainer.logger=[jsonl] >"$dir.log" 2>&1 ||
    { cat "$dir.log" >&2; echo "run $mode $i failed" >&2; exit 1; }
  python3 - "$dir/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tps = [r["perf/tokens_per_s"] for r in rows if "perf/tokens_per_s" in r][1:]
print(f"{statistics.median(tps):.1f}")
PY
}

declare -A results
echo "threads bench: $cores cores, 2 ranks, $steps steps per run, $runs runs per mode ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))"
for i in $(seq 1 "$runs"); do
  for mode in default omp1 all; do
    tps=$(run_once "$mode" "$i")
    echo "run $i $mode: $tps tokens/s"
    results[$mode]="${results[$mode]:-} $tps"
  done
done
python3 - "${results[default]}" "${results[omp1]}" "${results[all]}" <<'PY'
import statistics, sys
names = ["default", "omp1", "all"]
vals = {n: [float(x) for x in a.split()] for n, a in zip(names, sys.argv[1:])}
med = {n: statistics.median(v) for n, v in vals.items()}
for n in names:
    print(f"{n:8s} median {med[n]:.1f} tokens/s (min {min(vals[n]):.1f}, max {max(vals[n]):.1f})")
print(f"default / omp1 = {med['default'] / med['omp1']:.3f} (goal >= 1.0)")
print(f"default / all  = {med['default'] / med['all']:.3f} (the old default: every rank a thread per core)")
PY
