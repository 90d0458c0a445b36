#!/usr/bin/env bash
# Distributed SFT on SLURM with one ferl rank per GPU, started by srun (the external-launcher path).
#
# verl's SLURM recipe                                   | this script
#   #SBATCH --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 | the same
#   export MASTER_ADDR=<first node> MASTER_PORT=29500    | the same
#   srun python -m verl.trainer.fsdp_sft_trainer k=v ... | srun ferl sft k=v ...   (same keys)
#
# Each task reads SLURM_PROCID (rank), SLURM_NTASKS (world size), SLURM_LOCALID (GPU) and MASTER_ADDR/MASTER_PORT;
# rank 0 hosts the rendezvous store there. Every task also needs the same FERL_JOB_SECRET (a per-job secret that
# authenticates the store and the ranks' connections): this script makes a fresh one, which srun passes to every task.
# The config keys are verl's, unchanged.
# Submit with:  sbatch examples/slurm/sft_srun.sh
#SBATCH --job-name=ferl-sft
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
set -euo pipefail

FERL=${FERL:-ferl}                       # the `ferl` binary (same path on every node)
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
export MASTER_PORT=${MASTER_PORT:-29500}
export FERL_JOB_SECRET=${FERL_JOB_SECRET:-$(od -An -vtx1 -N32 /dev/urandom | tr -d ' \n')}   # 32 random bytes, hex
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$SLURM_CPUS_PER_TASK}

srun --kill-on-bad-exit=1 "$FERL" sft \
    data.train_files="$HOME/data/gsm8k/train.parquet" \
    data.val_files="$HOME/data/gsm8k/test.parquet" \
    data.prompt_key=extra_info \
    data.response_key=extra_info \
    "data.prompt_dict_keys=['question']" \
    "+data.response_dict_keys=['answer']" \
    data.micro_batch_size_per_gpu=4 \
    model.partial_pretrain="$HOME/models/Qwen2.5-0.5B-Instruct" \
    model.strategy=fsdp2 \
    trainer.default_local_dir="$HOME/checkpoints/gsm8k-sft" \
    trainer.project_name=gsm8k-sft \
    trainer.experiment_name=gsm8k-sft-qwen-2.5-0.5b-instruct \
    trainer.total_epochs=4 \
    trainer.logger='[console,jsonl]' \
    "$@"
