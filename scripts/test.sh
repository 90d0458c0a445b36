#!/usr/bin/env bash
# Runs every test of the workspace: sets up the venv (idempotent), builds every target once (the CLI tests run the
# `ferl` binary and the plugin tests load the cdylibs it leaves), then cargo nextest (cargo test where it is absent).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh
source scripts/env.sh
cargo build --workspace --all-targets
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@"
else
  cargo test --workspace --no-fail-fast "$@"
fi
