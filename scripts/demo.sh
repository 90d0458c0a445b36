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
# `ferl demo` makes the model and the data when missing (under --out) and trains with examples/configs/gsm8k_tiny.yaml;
# a pip-installed ferl runs the same command with the files its wheel carries.
"$ferl" demo --assets . --out "${FERL_DEMO_DIR:-runs/demo}" --nproc-per-node "${FERL_DEMO_NPROC:-2}" "$@"
