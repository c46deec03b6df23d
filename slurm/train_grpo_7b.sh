#!/bin/bash
# GRPO on GSM8K with Qwen2.5-7B-Instruct (configs/recipe/qwen2_5_7b_grpo.yaml) on one node x 8 GPUs.
#
#   sbatch slurm/train_grpo_7b.sh [OVERRIDES...]               e.g. sbatch slurm/train_grpo_7b.sh trainer.total_steps=10
#   sbatch slurm/train_grpo_7b.sh --plan-only [OVERRIDES...]   the pre-flight: megarl-plan on the same bring-up
#
# Size: edit --nodes / --gpus-per-node below or override them when submitting; trainer.nnodes and
# trainer.n_gpus_per_node are passed from the allocation unless you pass them yourself. Checkpoints and
# logs: $MEGARL_SHARED_DIR/checkpoints and /runs (default: the submit directory). Everything else as
# in slurm/train_grpo_70b.sh; docs/cluster.md.
#SBATCH --job-name=megarl-7b-grpo
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# sbatch runs a copy of this file: find slurm/ from the path it was submitted with.
here=$(dirname "${BASH_SOURCE[0]}")
[[ -f $here/ray_on_slurm.sh ]] || here=$(dirname "$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')")
# shellcheck source=slurm/ray_on_slurm.sh
source "$here/ray_on_slurm.sh"

megarl_job qwen2_5_7b_grpo "$@"
