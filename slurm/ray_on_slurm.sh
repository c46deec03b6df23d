#!/usr/bin/env bash
# Ray on a Slurm allocation, one command on it, Ray torn down: the bring-up every sbatch file in
# slurm/ uses.
#
#   slurm/ray_on_slurm.sh CMD [ARGS...]     run any command on a Ray cluster spanning the job's nodes
#   source slurm/ray_on_slurm.sh            define megarl_job and ray_on_slurm (what the sbatch files do):
#   megarl_job RECIPE [--plan-only] [OVERRIDES...]
#
# Run it inside a job: as (part of) an sbatch script, or under salloc through one task on an
# allocated node (`srun --nodes=1 --ntasks=1 --overlap slurm/ray_on_slurm.sh CMD`).
#
# What it does, in order (every line it prints starts with "[ray_on_slurm HH:MM:SS]"):
#  1. sources slurm/env.sh (network, NCCL, Ray and Python settings);
#  2. head node = the node this script runs on (Slurm runs the batch script on the first node of
#     `scontrol show hostnames $SLURM_JOB_NODELIST`); its address: MEGARL_HEAD_IP, else the IPv4
#     address of MEGARL_NET_IFNAME, else its host name's non-loopback IPv4 address, else the
#     first of `hostname -I`;
#  3. ports: three consecutive ports P (GCS), P+1 (Ray client), P+2 (dashboard), with P derived
#     from the job id in 20000-29999 (above Ray's worker ports 10002-19999, below the kernel's
#     ephemeral ports), moved on until all three are free on the head: two jobs sharing a node
#     never collide, and no fixed port (6379, 8265, 10001, 52365) is used. The other Ray ports are
#     picked by Ray (0 = any free port);
#  4. `ray start --head --block` in a background `srun --overlap` step on the head, then one
#     `ray start --address=... --block` step per other node (slurm/ray_node.sh); each node gets
#     --num-cpus from its SLURM_CPUS_ON_NODE, --num-gpus from SLURM_GPUS_ON_NODE (when Slurm
#     allocated GPUs) and --node-name = its Slurm node name; Ray's files go to MEGARL_RAY_TMPDIR on
#     each node, so a plain `ray.init()` elsewhere on the node never finds this cluster;
#  5. waits until every node is alive in the cluster, at most MEGARL_RAY_TIMEOUT seconds from
#     the start; a node whose Ray exits, or the timeout, ends the job with an error naming the
#     missing nodes ("all N nodes joined ..." on success);
#  6. exports RAY_ADDRESS=<head ip>:<P> (megarl-train then joins this cluster) and runs CMD;
#  7. on exit, failure or signal (trap on EXIT, INT, TERM): stops CMD if still running, sends
#     SIGTERM to each node's `ray start --block` through one more srun step (`ray_node.sh stop`;
#     Ray then stops the processes it started), cancels Ray steps still alive after
#     MEGARL_RAY_STOP_TIMEOUT, and exits with CMD's exit code (or the bring-up's: 1). It never
#     runs `ray stop`, which would kill every Ray process on the node, other jobs' included.
#
# Knobs (environment variables; all optional):
#   MEGARL_RAY_TIMEOUT=300       seconds for the whole bring-up (head up, every node joined)
#   MEGARL_RAY_STOP_TIMEOUT=30   seconds for Ray to stop before its steps are cancelled
#   MEGARL_RAY_TMPDIR            Ray's temp dir on every node (default /tmp/ray_megarl_<job id>; kept
#                                after a failed run for its logs, removed after a successful one)
#   MEGARL_RAY_START_ARGS        extra `ray start` arguments for every node (e.g. --include-dashboard=true)
#   MEGARL_HEAD_IP               the head's address, when the automatic choice is wrong
#   MEGARL_SHARED_DIR            megarl_job: root of checkpoints/ and runs/ (default: the submit dir)
#   MEGARL_PLAN_ONLY=1           megarl_job: run megarl-plan (the pre-flight) instead of megarl-train
#   MEGARL_RAY_SKIP_NODES        for tests: start no Ray on these nodes (comma-separated), so they
#                                never join and the bring-up must fail naming them
# Network and NCCL settings: slurm/env.sh. Docs: docs/cluster.md.
set -euo pipefail

RAY_ON_SLURM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

_ros_log() { echo "[ray_on_slurm $(date +%H:%M:%S)] $*" >&2; }
_ros_die() { _ros_log "error: $*"; exit 1; }

# _ros_has_key KEY ARGS...: whether a Hydra override of KEY is among ARGS.
_ros_has_key() {
    local key=$1 arg
    shift
    for arg in "$@"; do
        case $arg in "$key="* | "+$key="* | "++$key="*) return 0 ;; esac
    done
    return 1
}

# GPUs Slurm allocated per node (0 without GPUs).
_ros_gpus_per_node() {
    local gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}
    gpus=${gpus##*:}  # "h100:8" -> 8
    [[ $gpus =~ ^[0-9]+$ ]] || gpus=0
    echo "$gpus"
}

_ros_head_ip() {
    local ip=""
    if [[ -n ${MEGARL_HEAD_IP:-} ]]; then
        ip=$MEGARL_HEAD_IP
    elif [[ -n ${MEGARL_NET_IFNAME:-} ]]; then
        ip=$(ip -4 -o addr show dev "$MEGARL_NET_IFNAME" | awk '{split($4, a, "/"); print a[1]; exit}')
        [[ -n $ip ]] || _ros_die "no IPv4 address on MEGARL_NET_IFNAME=$MEGARL_NET_IFNAME on $(hostname)"
    else
        ip=$( (getent ahostsv4 "$(hostname)" || true) | awk '$1 !~ /^127\./ {print $1; exit}')
        [[ -n $ip ]] || ip=$(hostname -I | awk '{print $1}')
    fi
    [[ -n $ip ]] || _ros_die "cannot find the head's IP address: set MEGARL_HEAD_IP or MEGARL_NET_IFNAME (slurm/env.sh)"
    echo "$ip"
}

# _ros_ray_step NODE RAY_START_ARGS...: `ray start --block` on NODE in a background srun step.
_ros_ray_step() {
    local node=$1
    shift
    # shellcheck disable=SC2086  # MEGARL_RAY_START_ARGS is a list of words
    srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" --job-name="ray:$node" --kill-on-bad-exit=0 \
        bash "$RAY_ON_SLURM_DIR/ray_node.sh" start "$_ROS_TMPDIR" --disable-usage-stats --log-color=false \
        "$@" ${MEGARL_RAY_START_ARGS:-} &
    _ROS_STEP_PIDS[$node]=$!
}

_ros_teardown() {
    local rc=$? deadline node stop_s
    set +e
    trap - EXIT INT TERM
    if [[ -n ${_ROS_CMD_PID:-} ]] && kill -0 "$_ROS_CMD_PID" 2>/dev/null; then
        _ros_log "stopping the command (pid $_ROS_CMD_PID)"
        kill -TERM "$_ROS_CMD_PID"
        deadline=$((SECONDS + ${MEGARL_RAY_STOP_TIMEOUT:-30}))
        while kill -0 "$_ROS_CMD_PID" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
        kill -KILL "$_ROS_CMD_PID" 2>/dev/null
    fi
    if ((${#_ROS_STEP_PIDS[@]})); then
        _ros_log "stopping Ray on ${#_ROS_STEP_PIDS[@]} node(s)"
        stop_s=${MEGARL_RAY_STOP_TIMEOUT:-30}
        deadline=$((SECONDS + stop_s))
        timeout "$stop_s" srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" \
            --ntasks-per-node=1 --job-name=ray:stop bash "$RAY_ON_SLURM_DIR/ray_node.sh" stop "$_ROS_TMPDIR"
        for node in "${!_ROS_STEP_PIDS[@]}"; do
            while kill -0 "${_ROS_STEP_PIDS[$node]}" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
            if kill -0 "${_ROS_STEP_PIDS[$node]}" 2>/dev/null; then
                _ros_log "Ray on $node did not stop within MEGARL_RAY_STOP_TIMEOUT=${stop_s}: cancelling its step"
                kill -TERM "${_ROS_STEP_PIDS[$node]}" 2>/dev/null  # srun then kills the step's processes
            fi
        done
        wait 2>/dev/null
        if ((rc == 0)); then
            timeout "$stop_s" srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" \
                --ntasks-per-node=1 --job-name=ray:clean rm -rf "$_ROS_TMPDIR"
        else
            _ros_log "Ray's logs are kept in $_ROS_TMPDIR/session_latest/logs on each node"
        fi
    fi
    _ros_log "exit code $rc"
    exit "$rc"
}

_ros_on_signal() {
    _ros_log "received SIG$1: tearing down"
    exit $((128 + $2))
}

# ray_on_slurm CMD [ARGS...]: bring Ray up on the job's nodes, run CMD, tear down, exit with CMD's code.
ray_on_slurm() {
    (($#)) || _ros_die "usage: ray_on_slurm CMD [ARGS...]"
    [[ -n ${SLURM_JOB_ID:-} ]] || _ros_die "not inside a Slurm job: submit with sbatch (see docs/cluster.md)"
    [[ -n ${SLURMD_NODENAME:-} ]] || _ros_die "not on a node of job $SLURM_JOB_ID: under salloc, run it as" \
        "\`srun --nodes=1 --ntasks=1 --overlap $0 ...\`"
    # shellcheck source=slurm/env.sh
    source "$RAY_ON_SLURM_DIR/env.sh"
    command -v "$1" >/dev/null || _ros_die "$1: command not found on $(hostname) (submit with megarl's venv active, or set MEGARL_VENV)"
    command -v ray >/dev/null || _ros_die "ray: command not found on $(hostname) (submit with megarl's venv active, or set MEGARL_VENV)"

    local timeout=${MEGARL_RAY_TIMEOUT:-300} deadline node head head_ip port
    deadline=$(($(date +%s) + timeout))
    local -a nodes workers=()
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    head=$SLURMD_NODENAME
    for node in "${nodes[@]}"; do [[ $node == "$head" ]] || workers+=("$node"); done
    ((${#workers[@]} == ${#nodes[@]} - 1)) || _ros_die "this node ($head) is not in the job's node list (${nodes[*]})"
    head_ip=$(_ros_head_ip)
    port=$(python3 "$RAY_ON_SLURM_DIR/ray_nodes.py" free-port $((20000 + SLURM_JOB_ID * 3 % 9990)) 3)
    _ROS_TMPDIR=${MEGARL_RAY_TMPDIR:-/tmp/ray_megarl_$SLURM_JOB_ID}
    declare -gA _ROS_STEP_PIDS=()
    _ROS_CMD_PID=
    trap _ros_teardown EXIT
    trap '_ros_on_signal TERM 15' TERM
    trap '_ros_on_signal INT 2' INT

    local skip=",${MEGARL_RAY_SKIP_NODES:-},"
    _ros_log "job $SLURM_JOB_ID: ${#nodes[@]} node(s) ${nodes[*]}; Ray head on $head at $head_ip:$port" \
        "(bring-up timeout ${timeout} s)"
    if [[ $skip == *",$head,"* ]]; then
        _ros_log "MEGARL_RAY_SKIP_NODES: no Ray on $head"
    else
        _ros_ray_step "$head" --head --node-ip-address="$head_ip" --port="$port" \
            --ray-client-server-port=$((port + 1)) --dashboard-port=$((port + 2)) --include-dashboard=false \
            --dashboard-agent-listen-port=0
    fi
    python3 "$RAY_ON_SLURM_DIR/ray_nodes.py" wait-head "$head_ip:$port" "$deadline" "$head" \
        ${_ROS_STEP_PIDS[$head]:+"$head=${_ROS_STEP_PIDS[$head]}"}
    for node in "${workers[@]}"; do
        if [[ $skip == *",$node,"* ]]; then
            _ros_log "MEGARL_RAY_SKIP_NODES: no Ray on $node"
            continue
        fi
        _ros_ray_step "$node" --address="$head_ip:$port" --dashboard-agent-listen-port=0
    done
    local -a watch=()
    for node in "${!_ROS_STEP_PIDS[@]}"; do watch+=("$node=${_ROS_STEP_PIDS[$node]}"); done
    python3 "$RAY_ON_SLURM_DIR/ray_nodes.py" wait-nodes "$head_ip:$port" "$deadline" \
        "$(IFS=,; echo "${nodes[*]}")" "${watch[@]}"

    export RAY_ADDRESS=$head_ip:$port
    _ros_log "running: $*"
    "$@" &
    _ROS_CMD_PID=$!
    local rc=0
    wait "$_ROS_CMD_PID" || rc=$?
    _ROS_CMD_PID=
    exit "$rc"
}

# megarl_job RECIPE [--plan-only] [OVERRIDES...]: megarl-train (or, with --plan-only or
# MEGARL_PLAN_ONLY=1, megarl-plan) recipe=RECIPE through ray_on_slurm, with settings from the job:
#   trainer.nnodes / trainer.n_gpus_per_node   from the allocation, when it has GPUs
#   trainer.default_local_dir / trainer.log_dir  $MEGARL_SHARED_DIR/checkpoints and /runs
# each only when OVERRIDES do not set that key already. OVERRIDES come last.
megarl_job() {
    local recipe=${1:?megarl_job RECIPE [--plan-only] [OVERRIDES...]} program=megarl-train gpus shared
    shift
    if [[ ${1:-} == --plan-only ]]; then
        MEGARL_PLAN_ONLY=1
        shift
    fi
    if [[ ${MEGARL_PLAN_ONLY:-0} == 1 ]]; then
        program=megarl-plan
    fi
    local -a args=("recipe=$recipe")
    gpus=$(_ros_gpus_per_node)
    if ((gpus > 0)); then
        _ros_has_key trainer.nnodes "$@" || args+=("trainer.nnodes=$SLURM_JOB_NUM_NODES")
        _ros_has_key trainer.n_gpus_per_node "$@" || args+=("trainer.n_gpus_per_node=$gpus")
    fi
    shared=${MEGARL_SHARED_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
    _ros_has_key trainer.default_local_dir "$@" || args+=("trainer.default_local_dir=$shared/checkpoints")
    _ros_has_key trainer.log_dir "$@" || args+=("trainer.log_dir=$shared/runs")
    ray_on_slurm "$program" "${args[@]}" "$@"
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    ray_on_slurm "$@"
fi
