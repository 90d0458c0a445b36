#!/usr/bin/env bash
# Distributed SFT on SLURM through a ferl cluster: the head and one node agent per machine (ferl-cluster.sbatch),
# then one driver that reserves a resource group of nnodes x nproc-per-node GPU bundles and spawns a trainer actor
# per bundle, a data loader and a checkpointer.
#
# verl's command                                                  | ferl's
#   torchrun --nnodes=2 --nproc_per_node=8 ... \                  | ferl sft --nnodes 2 --nproc-per-node 8 \
#     -m verl.trainer.fsdp_sft_trainer k=v ...                    |   k=v ...
#
# Submit with:  sbatch examples/slurm/sft_cluster.sh   (ferl-cluster.sbatch exports FERL_ADDRESS and FERL_TOKEN,
# which `ferl sft` reads; on a cluster you started yourself pass --address HOST:PORT).
#SBATCH --job-name=ferl-sft
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=04:00:00
set -euo pipefail

FERL=${FERL:-ferl}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NNODES=${SLURM_NNODES:-2}
NPROC=${NPROC_PER_NODE:-8}

exec bash "$HERE/ferl-cluster.sbatch" "$FERL" sft --nnodes "$NNODES" --nproc-per-node "$NPROC" \
    data.train_files="$HOME/data/gsm8k/train.parquet" \
    data.val_files="$HOME/data/gsm8k/test.parquet" \
    data.prompt_key=extra_info \
    data.response_key=extra_info \
    "data.prompt_dict_keys=['question']" \
    "+data.response_dict_keys=['answer']" \
    data.micro_batch_size_per_gpu=4 \
    model.partial_pretrain="$HOME/models/Qwen2.5-0.5B-Instruct" \
    trainer.default_local_dir="$HOME/checkpoints/gsm8k-sft" \
    trainer.total_epochs=4 \
    trainer.logger='[console,jsonl]' \
    "$@"
