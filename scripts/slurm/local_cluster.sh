#!/bin/bash
# A real Slurm cluster on this machine, to try the SLURM path (sebulba.sbatch, srun, requeue,
# signals) before a real cluster: one slurmctld and NODES slurmd daemons (`slurmd -N n1` ...),
# every node on 127.0.0.1 with a port of its own, and a munged of its own.
#
#   scripts/slurm/local_cluster.sh up DIR [NODES]   # start (default 2 nodes: n1, n2), wait until idle
#   export SLURM_CONF=DIR/slurm.conf                # then sinfo, sbatch, srun, scontrol use it
#   scripts/slurm/local_cluster.sh down DIR         # stop the daemons it started, nothing else
#
# Everything it writes (slurm.conf, the munge key and socket, spool, state, logs, pid files,
# the job completion log DIR/log/jobcomp.txt) is under DIR. It installs nothing: missing
# programs are named with the Debian packages that hold them. Run it as root (slurmd starts
# every job's tasks as the submitting user). Nodes have CPUS (default 2) CPUs each, however many
# the machine has (they share it anyway), and no GPUs: submit with `sbatch --gpus-per-node=0`
# (docs/distributed.md). Ports: slurmctld on
# SLURMCTLD_PORT (default 16817), node i on NODE_PORT_BASE + i (default 17000 + i).
set -euo pipefail

usage() { echo "usage: $0 up DIR [NODES] | down DIR" >&2; exit 2; }
[ $# -ge 2 ] && { [ "$1" = up ] || [ "$1" = down ]; } || usage
action=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)
nodes=${3:-2}
cpus=${CPUS:-2}
ctld_port=${SLURMCTLD_PORT:-16817}
node_port_base=${NODE_PORT_BASE:-17000}
export SLURM_CONF="$dir/slurm.conf"

stop_pidfile() {  # stop the daemon whose pid file this cluster wrote, and wait until it is gone
    local pidfile=$1 pid
    [ -f "$pidfile" ] || return 0
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
}

down() {
    for pidfile in "$dir"/run/slurmd-*.pid; do stop_pidfile "$pidfile" & done
    wait
    stop_pidfile "$dir/run/slurmctld.pid"
    stop_pidfile "$dir/run/munged.pid"
}

up() {
    local missing=()
    for program in slurmctld:slurmctld slurmd:slurmd munged:munge sbatch:slurm-client srun:slurm-client \
                   scontrol:slurm-client sinfo:slurm-client; do
        command -v "${program%%:*}" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "${program%%:*}" \
            >/dev/null 2>&1 || missing+=("${program%%:*} (Debian package ${program##*:})")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        local list
        list=$(printf '%s, ' "${missing[@]}")
        echo "local_cluster.sh: missing ${list%, }; install them with: apt-get install slurmctld slurmd slurm-client munge" >&2
        exit 1
    fi
    [ "$(id -u)" -eq 0 ] || { echo "local_cluster.sh: run as root (slurmd starts tasks as the job's user)" >&2; exit 1; }
    export PATH="$PATH:/usr/sbin:/sbin"
    if [ -f "$dir/run/slurmctld.pid" ] && kill -0 "$(cat "$dir/run/slurmctld.pid")" 2>/dev/null; then
        echo "local_cluster.sh: a cluster is already running in $dir; '$0 down $dir' first" >&2
        exit 1
    fi
    mkdir -p "$dir"/{munge,spool,state,log,run}
    chmod 700 "$dir/munge"
    [ -f "$dir/munge/munge.key" ] || { dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none;
                                       chmod 400 "$dir/munge/munge.key"; }
    munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"

    local controller node_lines="" i
    controller=$(hostname -s)
    for i in $(seq "$nodes"); do
        node_lines+="NodeName=n$i NodeAddr=127.0.0.1 NodeHostname=$controller Port=$((node_port_base + i)) CPUs=$cpus State=UNKNOWN"$'\n'
    done
    cat > "$SLURM_CONF" <<EOF
# Written by scripts/slurm/local_cluster.sh: $nodes nodes on this machine.
ClusterName=sebulba-local
SlurmctldHost=$controller(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again this many seconds after its end (default 120).
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/slurmd-%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobRequeue=1
ReturnToService=2
SchedulerType=sched/builtin
# Look at pending jobs every 2 s (default 60): a requeued job starts again within seconds.
SchedulerParameters=sched_interval=2
# Every node is this machine: its CPUs= may exceed the machine's own.
SlurmdParameters=config_overrides
KillWait=30
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
AccountingStorageType=accounting_storage/none
$node_lines
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    slurmctld -c  # -c: a fresh state, no jobs left over from an earlier cluster in DIR
    for i in $(seq "$nodes"); do slurmd -N "n$i"; done
    for _ in $(seq 150); do  # 30 s
        if [ "$(sinfo -h -o '%t' 2>/dev/null | sort -u)" = "idle" ]; then
            echo "local cluster up: $(sinfo -h -o '%D nodes %N %t') ; export SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        sleep 0.2
    done
    echo "local_cluster.sh: nodes not idle after 30 s: $(sinfo -h -o '%N %t' 2>&1 | tr '\n' ' '); logs in $dir/log" >&2
    down
    exit 1
}

case "$action" in
    up) up ;;
    down) down; echo "local cluster in $dir stopped" ;;
esac
