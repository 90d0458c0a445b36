#!/usr/bin/env bash
# The main job on its embedded default: a local cluster on CPU, a tiny random-init Qwen2 with the real Qwen tokenizer,
# SFT on GSM8K for a few minutes: 2 trainer ranks (FULL_SHARD) on an embedded cluster, like
# `torchrun --nproc_per_node 2 -m verl.trainer.fsdp_sft_trainer`. Extra `key=value` arguments are verl overrides. Leaves everything under runs/demo (model, parquet data, checkpoints, metrics.jsonl).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh
source scripts/env.sh
# The first-party plugins (loggers `tensorboard` and `csv`, dataset `alpaca`, kernels `liger`, reward `gsm8k`) are
# built with ferl: cargo puts their libraries beside the binary, where `ferl` finds them without FERL_PLUGIN_PATH.
cargo build --release -p ferl -p ferl-plugin-tensorboard -p ferl-plugin-csv -p ferl-plugin-alpaca -p ferl-plugin-liger \
  -p ferl-plugin-gsm8k
ferl="${CARGO_TARGET_DIR:-target}/release/ferl"
out="${FERL_DEMO_DIR:-runs/demo}"
mkdir -p "$out"
[ -f "$out/model/model.safetensors" ] || "$ferl" model init --config assets/models/tiny-qwen2/config.json \
  --tokenizer assets/tokenizers/qwen3 --out "$out/model" --seed 0
[ -f "$out/data/train.parquet" ] || "$ferl" data gsm8k --input-dir assets/data/gsm8k --local-dir "$out/data"
"$ferl" sft --nproc-per-node "${FERL_DEMO_NPROC:-2}" --config examples/configs/gsm8k_tiny.yaml \
  data.train_files="$out/data/train.parquet" data.val_files="$out/data/test.parquet" \
  model.partial_pretrain="$out/model" trainer.default_local_dir="$out/checkpoints" "$@"
