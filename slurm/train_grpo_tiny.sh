#!/bin/bash
# The tiny CPU GRPO recipe (configs/recipe/tiny_cpu_grpo.yaml, megarl-train's default) as a Slurm job:
# one node, two CPUs (the recipe's trainer.n_cpu_ranks), no GPU, through the same Ray bring-up as the
# GPU recipes (slurm/ray_on_slurm.sh). A check that Slurm, Ray and megarl work together on a cluster.
#
#   sbatch slurm/train_grpo_tiny.sh [OVERRIDES...]      e.g. sbatch slurm/train_grpo_tiny.sh trainer.total_steps=5
#   sbatch slurm/train_grpo_tiny.sh --plan-only         megarl-plan instead of megarl-train
#
# Submit from the repository root with megarl's venv active (or set MEGARL_VENV). Checkpoints and logs
# go to $MEGARL_SHARED_DIR/checkpoints and /runs (default: the directory you submitted from); the job's
# output to megarl-tiny-<job id>.out there. Docs: docs/cluster.md.
#SBATCH --job-name=megarl-tiny
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# sbatch runs a copy of this file: find slurm/ from the path it was submitted with.
here=$(dirname "${BASH_SOURCE[0]}")
[[ -f $here/ray_on_slurm.sh ]] || here=$(dirname "$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')")
# shellcheck source=slurm/ray_on_slurm.sh
source "$here/ray_on_slurm.sh"

megarl_job tiny_cpu_grpo "$@"
