#!/usr/bin/env bash
# Prepared GPU benchmark (issue 4): bf16 SFT steps of a Qwen2.5-0.5B-shaped, randomly initialised model (hidden 896,
# 24 layers, 14 heads, 2 kv heads, intermediate 4864, vocab 151,936, tied embeddings) at seq 2048 on one GPU, with
# tokens/s and MFU against the H200's 989 TFLOP/s dense bf16 peak (goal: MFU >= 0.45).
#
# MFU = step FLOPs / step time / peak, step FLOPs = tokens * (6 * N + 12 * L * d * T): 6 FLOPs per parameter per token
# for forward + backward (N = 494,032,768, the tied matrix counted once), plus attention QK^T and PV (PaLM's
# convention: 12 * layers * (heads * head_dim) * seq per token, the full T x T square). Checkpointing's recomputed
# forward is not counted. The formula lives in bench/src/train/shape.rs; the binary also prints `_mfu_6n` (the
# trainer's `perf/mfu`, 6 * N only).
#
# No build happens here: it runs the release binary carried from the build machine (FERL_BENCH_BIN, default
# target/release/ferl-bench) against this machine's torch (2.11.0) libraries, found through python. Under ~5 minutes
# on an H200: two runs of STEPS steps (the single-process store, then ferl-fsdp's FULL_SHARD store at world size 1 over
# NCCL with fewer steps); the first step of each run is a warm-up.
#
# Knobs (environment): STEPS (default 20), BATCH (samples per step, default 16), MICRO (micro-batch, default 8),
# CKPT=1 (gradient checkpointing; off by default — 80 GB+ of HBM fits micro-batch 8 x 2048 without it), SEQ (2048),
# PEAK_TFLOPS (989), PYTHON (an interpreter with torch), SKIP_FSDP=1, PACKED_LEN (8192: the packed attention rows,
# GSM8K sequences in one row, ms of forward + backward by torch's variable-length kernel beside the dense mask),
# SP_SEQ (4096: the sequence-parallel rows, peak device memory per rank of ulysses_sequence_parallel_size=2 beside one
# rank and 2-way data parallelism, tiny model, one GPU per rank over NCCL; skipped with a line saying so on a machine
# with fewer than 2 GPUs).
# A dry run on a CPU machine: DEVICE=cpu SHAPE=test SEQ=64 STEPS=2 BATCH=2 MICRO=1 PACKED_LEN=512 SP_SEQ=64 \
#   bench/gpu/h200_sft.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

fail() { echo "H200 SFT BENCH FAILED: $*" >&2; exit 1; }

BIN="${FERL_BENCH_BIN:-target/release/ferl-bench}"
DEVICE="${DEVICE:-cuda}"
SHAPE="${SHAPE:-qwen2.5-0.5b}"
SEQ="${SEQ:-2048}"
STEPS="${STEPS:-20}"
BATCH="${BATCH:-16}"
MICRO="${MICRO:-8}"
PEAK_TFLOPS="${PEAK_TFLOPS:-989}"
[ -x "$BIN" ] || fail "$BIN is missing or not executable (build it on the build machine: cargo build --release -p ferl-bench)"

# torch's library folder, from the first python that imports torch.
TORCH_LIB=""
for py in "${PYTHON:-}" "${FERL_VENV:-$HOME/.cache/ferl/venv}/bin/python" python3 python; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    if TORCH_LIB=$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null); then
        PY="$py"; break
    fi
    TORCH_LIB=""
done
[ -n "$TORCH_LIB" ] || fail "no python with torch found (set PYTHON=/path/to/python of an environment with torch 2.11.0)"
[ -f "$TORCH_LIB/libtorch_cpu.so" ] || fail "$TORCH_LIB has no libtorch_cpu.so"
echo "torch: $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)') at $TORCH_LIB"
export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FERL_TORCH_LIB="$TORCH_LIB"

if [ "$DEVICE" = cuda ]; then
    [ -f "$TORCH_LIB/libtorch_cuda.so" ] || fail "$TORCH_LIB has no libtorch_cuda.so (a CPU-only torch build?)"
    command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: no NVIDIA driver on this machine"
    GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1) \
        || fail "nvidia-smi could not query a GPU"
    [ -n "$GPU" ] || fail "nvidia-smi lists no GPU"
    echo "GPU: $GPU"
    "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "torch sees no CUDA device")' \
        || fail "torch in $PY sees no CUDA device"
    case "$GPU" in *H200*|*H100*) ;; *) echo "note: not an H100/H200; MFU is still taken against ${PEAK_TFLOPS} TFLOP/s";; esac
fi

args=(train --device "$DEVICE" --model-shape "$SHAPE" --seq-len "$SEQ" --batch "$BATCH" --micro-batch "$MICRO"
      --peak-tflops "$PEAK_TFLOPS")
[ "${CKPT:-0}" = 1 ] && args+=(--gradient-checkpointing)

echo "== single-process store =="
timeout 240 "$BIN" "${args[@]}" --steps "$STEPS" --store local || fail "the single-process run failed (exit $?)"
if [ "${SKIP_FSDP:-0}" != 1 ]; then
    echo "== ferl-fsdp FULL_SHARD store, world size 1 (NCCL on CUDA) =="
    timeout 180 "$BIN" "${args[@]}" --steps $(( STEPS < 6 ? STEPS : 6 )) --store fsdp \
        || fail "the FULL_SHARD run failed (exit $?)"
fi
echo "== packed attention (use_remove_padding): varlen kernel beside the dense T x T mask it replaced =="
timeout 120 "$BIN" train --packed-attention --packed-len "${PACKED_LEN:-8192}" --device "$DEVICE" --dtype bf16 \
    || fail "the packed attention run failed (exit $?)"
echo "== sequence parallelism (ulysses_sequence_parallel_size=2): peak memory per rank beside one rank and 2-way DP =="
GPUS=2
[ "$DEVICE" = cuda ] && GPUS=$(nvidia-smi -L | grep -c '^GPU' || true)
if [ "$GPUS" -lt 2 ]; then
    echo "sequence parallelism skipped: it needs 2 GPUs (one per rank, NCCL), this machine has $GPUS"
else
    timeout 300 "$BIN" train --sequence-parallel 2 --seq-len "${SP_SEQ:-4096}" --steps 3 --device "$DEVICE" \
        --dtype bf16 || fail "the sequence-parallel run failed (exit $?)"
fi
echo "H200 SFT BENCH DONE"
