#!/usr/bin/env bash
# Runs every test of the workspace: sets up the venv (idempotent), then cargo nextest (cargo test where nextest is absent).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh
source scripts/env.sh
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@"
else
  cargo test --workspace --no-fail-fast "$@"
fi
