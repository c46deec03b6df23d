#!/usr/bin/env bash
# A Slurm cluster on this one machine, for tests and for trying the sbatch files in slurm/.
#
#   tools/slurm_local.sh start [--nodes N]   install (Debian apt, when missing), configure, start, wait until idle
#   tools/slurm_local.sh stop                stop the daemons this script started
#   tools/slurm_local.sh status              print the nodes; exit 0 if slurmctld answers
#   tools/slurm_local.sh env                 print `export SLURM_CONF=...` (eval it before sbatch/srun)
#
# `start` is idempotent: with the same node count and a running cluster it only waits for the nodes.
# It needs root (slurmd starts jobs as their users; Debian's package runs everything as root here).
# Exit status 2: Slurm cannot be installed or run here (not root, no apt-get, apt-get failed).
#
# Nodes: N (default 2) Slurm nodes n1..nN, all on this machine, each served by its own slurmd
# (`slurmd -N`), so a job with --nodes=2 gets two "nodes" and exercises the multi-node Ray bring-up
# (head on n1, a worker started by srun on n2). Every node declares the machine's CPUs and 90% of its
# memory (`slurmd -C`); SlurmdParameters=config_overrides keeps Slurm from draining them for
# oversubscribing. ProctrackType=proctrack/linuxproc and TaskPlugin=task/none: no cgroups needed.
#
# Everything lives under $MEGARL_SLURM_STATE (default /var/tmp/megarl-slurm): slurm.conf, daemon logs
# (slurmctld.log, slurmd-n1.log, ...), pid files, spool and state. /etc/slurm is never touched, so a
# real Slurm configuration on the machine is left alone; clients find this one through SLURM_CONF.
# Several clusters can run side by side (two test runs on one machine): give each its own
# MEGARL_SLURM_STATE, MEGARL_SLURM_PORT and MEGARL_SLURM_FIRST_JOB_ID; munged is shared, and `stop` leaves
# it running while another slurmctld still uses it.
set -euo pipefail

STATE=${MEGARL_SLURM_STATE:-/var/tmp/megarl-slurm}
CONF=$STATE/slurm.conf
CTLD_PORT=${MEGARL_SLURM_PORT:-6817}  # slurmctld; slurmd n<i> listens on CTLD_PORT + 100 + i
FIRST_JOB_ID=${MEGARL_SLURM_FIRST_JOB_ID:-1}  # job ids name Ray's temp dirs: clusters side by side start apart

log() { echo "slurm_local: $*" >&2; }
die() { log "error: $1"; exit "${2:-1}"; }

install_slurm() {
    if command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v munged >/dev/null; then
        return
    fi
    command -v apt-get >/dev/null || die "Slurm is not installed and apt-get is missing: install slurmctld, slurmd, slurm-client and munge" 2
    [[ $(id -u) == 0 ]] || die "Slurm is not installed; installing it needs root (apt-get install slurmctld slurmd slurm-client munge)" 2
    log "installing slurmctld slurmd slurm-client munge (apt-get)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd \
        slurm-client munge >/dev/null; }; then
        die "apt-get could not install slurmctld slurmd slurm-client munge" 2
    fi
}

write_conf() {  # write_conf NODES
    local nodes=$1 host cpus mem
    host=$(hostname -s)
    cpus=$(slurmd -C | sed -n 's/.* CPUs=\([0-9]*\).*/\1/p')
    mem=$(slurmd -C | sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p')
    mem=$((mem * 9 / 10))
    mkdir -p "$STATE/state"
    cat > "$CONF.tmp" <<EOF
# Written by megarl tools/slurm_local.sh: $nodes node(s) on $host.
ClusterName=megarl-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
KillWait=10
FirstJobId=$FIRST_JOB_ID
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd-%n.log
NodeName=n[1-$nodes] NodeHostname=$host NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 101))-$((CTLD_PORT + 100 + nodes)) CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    mv "$CONF.tmp" "$CONF"
}

alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return  # a munged is already serving this machine
    fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged
    touch "$STATE/munged.started"
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.1
    done
    die "munged did not start (see /var/log/munge/munged.log)"
}

node_count() { sed -n 's/^# Written by megarl.*: \([0-9]*\) node.*/\1/p' "$CONF" 2>/dev/null; }

wait_idle() {  # wait_idle NODES
    local nodes=$1 states
    export SLURM_CONF=$CONF
    for i in $(seq 120); do
        states=$(sinfo -h -N -o '%N %T' 2>/dev/null || true)
        if [[ $(grep -c ' idle$' <<<"$states") == "$nodes" ]]; then
            log "up: $nodes node(s) idle (SLURM_CONF=$CONF)"
            return
        fi
        if ((i == 20)) && grep -qE 'down|drain' <<<"$states"; then
            scontrol update nodename="n[1-$nodes]" state=resume 2>/dev/null || true
        fi
        sleep 0.5
    done
    log "nodes: ${states:-no answer from slurmctld}"
    tail -n 5 "$STATE"/slurmctld.log "$STATE"/slurmd-*.log >&2 || true
    die "the local Slurm did not become idle within 60 s"
}

start() {
    local nodes=2
    while (($#)); do
        case $1 in
            --nodes) nodes=$2; shift 2 ;;
            *) die "unknown argument $1" 2 ;;
        esac
    done
    [[ $(id -u) == 0 ]] || die "the local Slurm needs root (slurmd runs jobs as their users)" 2
    install_slurm
    mkdir -p "$STATE"
    if [[ $(node_count) != "$nodes" ]] || ! alive "$STATE/slurmctld.pid"; then
        stop_daemons
        write_conf "$nodes"
    fi
    start_munge
    alive "$STATE/slurmctld.pid" || slurmctld -f "$CONF"
    for i in $(seq "$nodes"); do
        alive "$STATE/slurmd-n$i.pid" || slurmd -f "$CONF" -N "n$i"
    done
    wait_idle "$nodes"
}

stop_daemons() {
    local pidfile pid
    for pidfile in "$STATE"/slurmd-*.pid "$STATE"/slurmctld.pid; do
        [[ -f $pidfile ]] || continue
        pid=$(cat "$pidfile")
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
        rm -f "$pidfile"
    done
}

other_state() {  # the state directory of another running slurmctld started by this script, if any
    local pid conf
    for pid in $(pgrep -x slurmctld); do
        conf=$(tr '\0' '\n' < "/proc/$pid/cmdline" 2>/dev/null | sed -n '/^-f$/{n;p;q}')
        [[ $conf == */slurm.conf && -d ${conf%/slurm.conf} ]] && { echo "${conf%/slurm.conf}"; return; }
    done
}

stop() {
    local other
    stop_daemons
    if [[ -f $STATE/munged.started && -f /run/munge/munged.pid ]]; then
        other=$(other_state)
        if [[ -n $other ]]; then  # munged still serves that cluster: its stop ends munged
            mv "$STATE/munged.started" "$other/munged.started"
        else
            kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
            rm -f "$STATE/munged.started"
        fi
    fi
    log "stopped"
}

status() {
    export SLURM_CONF=$CONF
    if [[ ! -f $CONF ]] || ! alive "$STATE/slurmctld.pid"; then
        log "not running"
        return 1
    fi
    sinfo -N
}

case ${1:-} in
    start) shift; start "$@" ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start [--nodes N] | stop | status | env" >&2; exit 2 ;;
esac
