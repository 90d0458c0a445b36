#!/usr/bin/env bash
# Installs what ferl needs to build and test: a Python venv with torch==2.11.0 (libtorch for tch, and the PyTorch
# reference the parity tests and benchmarks compare against). Idempotent: a venv that already has every pinned package
# is left alone, so repeated runs cost a second.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
pins=(torch==2.11.0 numpy==2.4.6 safetensors==0.8.0 transformers==5.24.0 tensorboard==2.21.0 pyarrow==26.0.1 peft==0.21.2 mlflow-skinny==3.17.2 maturin==1.16.0 trl==1.16.0)
stamp="$FERL_VENV/.ferl-pins"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ]; then
  exit 0
fi
if [ ! -x "$FERL_VENV/bin/python" ]; then
  echo "ferl setup: creating the venv at $FERL_VENV" >&2
  python3 -m venv "$FERL_VENV"
fi
echo "ferl setup: installing ${pins[*]} into $FERL_VENV (torch is ~5 GB the first time)" >&2
"$FERL_VENV/bin/python" -m pip install --disable-pip-version-check -q "${pins[@]}"
echo "${pins[*]}" > "$stamp"
