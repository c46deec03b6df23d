#!/bin/bash
# GRPO on GSM8K with Llama-3.1-70B-Instruct (configs/recipe/llama3_1_70b_grpo.yaml) on 8 nodes x 8 GPUs.
#
#   sbatch slurm/train_grpo_70b.sh [OVERRIDES...]               e.g. sbatch slurm/train_grpo_70b.sh trainer.total_steps=10
#   sbatch slurm/train_grpo_70b.sh --plan-only [OVERRIDES...]   the pre-flight: megarl-plan on the same bring-up
#   MEGARL_PLAN_ONLY=1 sbatch slurm/train_grpo_70b.sh           the same
#
# Size: edit --nodes and --gpus-per-node below, or override them when submitting
# (`sbatch --nodes=16 slurm/train_grpo_70b.sh`; command-line options win over #SBATCH lines).
# trainer.nnodes and trainer.n_gpus_per_node are passed from the allocation (SLURM_JOB_NUM_NODES and
# the GPUs per node), unless you pass them yourself. The recipe's layout, actor TP=8 x PP=4 (VPP=5),
# must divide the world size (data parallel = GPUs / 32): check a new size with --plan-only first.
# Site settings (partition, account, QOS, constraint) go below as more #SBATCH lines.
#
# Shared storage: checkpoints and logs go to $MEGARL_SHARED_DIR/checkpoints and /runs (default: the
# directory you submitted from, which must be on a file system every node sees). The model
# (actor_rollout_ref.model.path) and data (data/gsm8k/*.parquet, tools/prepare_gsm8k.py) must be
# readable from every node too. Network and NCCL settings: slurm/env.sh. Docs: docs/cluster.md.
#SBATCH --job-name=megarl-70b-grpo
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# sbatch runs a copy of this file: find slurm/ from the path it was submitted with.
here=$(dirname "${BASH_SOURCE[0]}")
[[ -f $here/ray_on_slurm.sh ]] || here=$(dirname "$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')")
# shellcheck source=slurm/ray_on_slurm.sh
source "$here/ray_on_slurm.sh"

megarl_job llama3_1_70b_grpo "$@"
