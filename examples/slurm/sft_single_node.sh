#!/usr/bin/env bash
# Distributed SFT on one machine, the two ways a verl user launches it.
#
#   verl:  torchrun --standalone --nnodes=1 --nproc_per_node=$N -m verl.trainer.fsdp_sft_trainer k=v ...
#   ferl:  ferl sft --nproc-per-node $N k=v ...                      (embedded cluster, one trainer actor per GPU)
#   or:    torchrun --no-python --standalone --nproc_per_node=$N ferl sft k=v ...   (torchrun starts the ranks;
#          they need FERL_JOB_SECRET, which this script sets to a fresh `openssl rand -hex 32`)
#
# Usage: examples/slurm/sft_single_node.sh N [actors|torchrun] [extra k=v ...]
set -euo pipefail

N=${1:-8}
MODE=${2:-actors}
shift $(( $# < 2 ? $# : 2 ))
FERL=${FERL:-ferl}
KEYS=(
    data.train_files="$HOME/data/gsm8k/train.parquet"
    data.val_files="$HOME/data/gsm8k/test.parquet"
    data.micro_batch_size_per_gpu=4
    model.partial_pretrain="$HOME/models/Qwen2.5-0.5B-Instruct"
    trainer.default_local_dir="$HOME/checkpoints/gsm8k-sft"
    trainer.total_epochs=1
)
case "$MODE" in
    actors) exec "$FERL" sft --nproc-per-node "$N" "${KEYS[@]}" "$@" ;;
    # Every torchrun rank needs the same per-job secret (it authenticates the ranks' connections to each other).
    torchrun) export FERL_JOB_SECRET=${FERL_JOB_SECRET:-$(openssl rand -hex 32)}
              exec torchrun --no-python --standalone --nnodes=1 --nproc_per_node="$N" "$FERL" sft "${KEYS[@]}" "$@" ;;
    *) echo "mode must be actors or torchrun, not $MODE" >&2; exit 2 ;;
esac
