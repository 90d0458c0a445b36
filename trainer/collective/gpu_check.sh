#!/usr/bin/env bash
# GPU check of ferl-collective's NCCL backend, for a machine with one CUDA GPU. Under 2 minutes once the test binary
# is built (building ferl-collective's tests from scratch takes longer; build first with the same command minus the
# timeout). World size 1 only: NCCL refuses two ranks on one GPU ("Duplicate GPU detected").
# Checks: torch sees the GPU, NCCL (torch's libnccl.so.2) loads, and all-reduce / all-gather / reduce-scatter /
# broadcast / all-to-all / barrier on CUDA fp32 and bf16 tensors equal the reference.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$FERL_VENV/bin/python" -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU"; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
log=$(mktemp)
timeout 110 cargo nextest run -p ferl-collective --test threads nccl_backend --no-capture 2>&1 | tee "$log"
if grep -q "SKIP nccl_backend" "$log"; then
    echo "GPU CHECK FAILED: the NCCL test skipped (see the SKIP line for why)"; exit 1
fi
grep -q "NCCL OK" "$log" || { echo "GPU CHECK FAILED: no 'NCCL OK' line"; exit 1; }
echo "GPU CHECK PASSED"
