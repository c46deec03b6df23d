# shellcheck shell=bash
# Network and runtime settings for multi-node runs: the one file to adapt to a cluster.
#
# slurm/ray_on_slurm.sh sources it on the head node before starting Ray; the srun steps that start
# Ray on every node inherit these variables, and so do Ray's worker processes (the trainer's ranks
# and the rollout engines). Every line keeps a value already set in the environment, so
# `NCCL_DEBUG=INFO sbatch slurm/train_grpo_70b.sh` works without editing. Left empty, nothing
# is forced: the libraries choose for themselves, which is right on a single node.

# --- Network interface -------------------------------------------------------------------------
# The interface the nodes reach each other on (e.g. ib0, bond0, enp65s0f0). When set, the Ray head
# listens on its IPv4 address, and NCCL's bootstrap/socket transport and gloo use it. When empty,
# the head's address is its host name's non-loopback IPv4 address (else the first of `hostname -I`),
# and NCCL/gloo pick an interface themselves (they avoid lo and docker*). MEGARL_HEAD_IP overrides
# the head's address outright.
export MEGARL_NET_IFNAME=${MEGARL_NET_IFNAME:-}
if [[ -n $MEGARL_NET_IFNAME ]]; then
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$MEGARL_NET_IFNAME}
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$MEGARL_NET_IFNAME}
fi

# --- InfiniBand / RoCE (NCCL) ------------------------------------------------------------------
# MEGARL_IB_HCA: the HCAs NCCL may use (NCCL_IB_HCA syntax: "mlx5_0,mlx5_1", "=mlx5_0:1", "^mlx5_4");
# empty: all it finds. Other settings sites commonly need, set them here or in the environment:
#   NCCL_IB_GID_INDEX=3        RoCE v2 (InfiniBand needs nothing)
#   NCCL_IB_TIMEOUT=22         longer IB retransmit timeout on large or congested fabrics
#   NCCL_IB_DISABLE=1          TCP sockets only (slow; to tell a fabric problem from anything else)
#   NCCL_NET_GDR_LEVEL=PHB     GPUDirect RDMA policy
export MEGARL_IB_HCA=${MEGARL_IB_HCA:-}
if [[ -n $MEGARL_IB_HCA ]]; then
    export NCCL_IB_HCA=${NCCL_IB_HCA:-$MEGARL_IB_HCA}
fi
# WARN prints only problems; INFO names the transport of every connection (look for NET/IB, not NET/Socket).
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# --- Ray ---------------------------------------------------------------------------------------
# Token authentication: Ray's ports listen on every interface of every node, and without a token anyone who
# reaches them can run code in the job's cluster. One fresh token per job, in the environment every srun step
# inherits (the head, the workers and the driver), written nowhere. RAY_AUTH_MODE=disabled turns it off.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
if [[ $RAY_AUTH_MODE == token && -z ${RAY_AUTH_TOKEN:-} ]]; then
    RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
    export RAY_AUTH_TOKEN
fi
export RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}

# --- Python ------------------------------------------------------------------------------------
# By default the job uses the environment it was submitted from (sbatch exports it), so submit with
# megarl's virtual environment active. MEGARL_VENV=/path/to/.venv activates that one instead.
if [[ -n ${MEGARL_VENV:-} ]]; then
    # shellcheck disable=SC1091
    source "$MEGARL_VENV/bin/activate"
fi
