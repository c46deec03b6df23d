#!/usr/bin/env bash
# One node's part of the Ray bring-up, run on that node by slurm/ray_on_slurm.sh through srun.
#
#   ray_node.sh start DIR RAY_START_ARGS...   `ray start --block` with this node's name, CPUs and GPUs;
#                                             Ray's temp dir is DIR; returns when Ray stops
#   ray_node.sh stop DIR                      ask the Ray started here for this job to stop
#
# `stop` sends SIGTERM to this job's `ray start --block` only (Ray then stops the processes it
# started), unlike `ray stop`, which kills every Ray process on the node. A Ray that stops because
# it was asked to exits 0; one that dies on its own exits non-zero with an error naming the node.
set -uo pipefail

mode=${1:?usage: ray_node.sh start|stop DIR [RAY_START_ARGS...]}
dir=${2:?usage: ray_node.sh start|stop DIR [RAY_START_ARGS...]}
shift 2
node=${SLURMD_NODENAME:?ray_node.sh runs inside a Slurm step}
pidfile=$dir/ray-$node.pid
stopfile=$dir/ray-$node.stop

case $mode in
    start)
        mkdir -p "$dir"
        rm -f "$stopfile"
        gpus=()
        if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
            gpus=(--num-gpus="$SLURM_GPUS_ON_NODE")
        fi
        ray start --block --temp-dir="$dir" --node-name="$node" --num-cpus="${SLURM_CPUS_ON_NODE:-1}" \
            "${gpus[@]}" "$@" &
        echo $! > "$pidfile"
        wait $!
        rc=$?
        rm -f "$pidfile"
        if [[ -f $stopfile ]]; then
            rm -f "$stopfile"
            exit 0
        fi
        echo "[ray_on_slurm $(date +%H:%M:%S)] error: Ray on $node exited with code $rc" >&2
        exit "$rc"
        ;;
    stop)
        [[ -f $pidfile ]] || exit 0
        : > "$stopfile"
        kill -TERM "$(cat "$pidfile")" 2>/dev/null || true
        ;;
    *)
        echo "usage: ray_node.sh start|stop DIR [RAY_START_ARGS...]" >&2
        exit 2
        ;;
esac
