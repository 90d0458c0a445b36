#!/usr/bin/env bash
# Builds ferl's Python wheel and prints its path: the `ferl` launcher (wheel/, maturin `bindings = "bin"`) on PATH,
# and under the environment's prefix `lib/ferl/` (the ferl binary and the first-party plugins, found beside it) and
# `share/ferl/` (what `ferl demo` reads: the tiny Qwen2 config, the Qwen tokenizer, GSM8K, the demo config). The
# wheel depends on torch==2.11.0 and finds libtorch through it when it runs, so `pip install` is the whole set-up.
# FERL_WHEEL_PROFILE=dev packs the debug build (default: release); FERL_WHEEL_PREBUILT=1 packs what that profile's
# last build left instead of building (CI's wheel test packs what `scripts/test.sh` built).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh
source scripts/env.sh
profile="${FERL_WHEEL_PROFILE:-release}"
target="${CARGO_TARGET_DIR:-$PWD/target}"
plugins=(tensorboard csv alpaca liger gsm8k)
packages=(-p ferl)
for p in "${plugins[@]}"; do packages+=(-p "ferl-plugin-$p"); done
[ "${FERL_WHEEL_PREBUILT:-0}" = 1 ] || cargo build --profile "$profile" "${packages[@]}" >&2
built="$target/$([ "$profile" = dev ] && echo debug || echo "$profile")"

staging=wheel/staging/data
rm -rf wheel/staging
mkdir -p "$staging/lib/ferl" "$staging/share/ferl/examples/configs" "$staging/share/ferl/assets/models" \
  "$staging/share/ferl/assets/tokenizers" "$staging/share/ferl/assets/data"
# Debug sections are most of the binary's size; a wheel ships without them.
objcopy --strip-debug "$built/ferl" "$staging/lib/ferl/ferl"
for p in "${plugins[@]}"; do
  objcopy --strip-debug "$built/libferl_plugin_$p.so" "$staging/lib/ferl/libferl_plugin_$p.so"
done
cp -r assets/models/tiny-qwen2 "$staging/share/ferl/assets/models/"
cp -r assets/tokenizers/qwen3 "$staging/share/ferl/assets/tokenizers/"
cp -r assets/data/gsm8k "$staging/share/ferl/assets/data/"
cp examples/configs/gsm8k_tiny.yaml "$staging/share/ferl/examples/configs/"

# The launcher is its own small workspace; its own target folder keeps its `ferl` apart from the real one.
out="$target/wheels"
mkdir -p "$out"
CARGO_TARGET_DIR="$target/wheel-launcher" "$FERL_VENV/bin/maturin" build --quiet --release \
  -m wheel/Cargo.toml --out "$out" >&2
ls -t "$out"/ferl-*.whl | head -1
