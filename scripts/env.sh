# Sourced by the other scripts: where ferl's Python venv lives and how the build finds libtorch.
# FERL_VENV may be set to use another venv; it must hold torch==2.11.0.
export FERL_VENV="${FERL_VENV:-$HOME/.cache/ferl/venv}"
export LIBTORCH_USE_PYTORCH=1
export PATH="$FERL_VENV/bin:$PATH"
FERL_TORCH_LIB="$FERL_VENV/lib/python3.$("$FERL_VENV/bin/python" -c 'import sys;print(sys.version_info[1])' 2>/dev/null || echo 11)/site-packages/torch/lib"
export FERL_TORCH_LIB
export LD_LIBRARY_PATH="$FERL_TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
