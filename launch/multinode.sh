#!/usr/bin/env bash
# Run one process of a multi-host job on this host: start it once per host, same command everywhere.
#
#   launch/multinode.sh COORD_HOST:PORT NUM_PROCS PROC_ID -- CMD [ARGS...]
#
# e.g. on host A (10.0.0.1), the coordinator:  launch/multinode.sh 10.0.0.1:12355 2 0 -- jetspec-jax train --config C
#      on host B:                              launch/multinode.sh 10.0.0.1:12355 2 1 -- jetspec-jax train --config C
#
# Exports JETSPEC_COORDINATOR, JETSPEC_NUM_PROCESSES and JETSPEC_PROCESS_ID (which
# jetspec_jax.distributed.initialize() reads) and execs the command, so its exit status is this
# script's. COORD_HOST must be an address of the PROC_ID 0 host that every host can reach.
set -euo pipefail

die() {
  echo "multinode.sh: $*" >&2
  echo "usage: launch/multinode.sh COORD_HOST:PORT NUM_PROCS PROC_ID -- CMD [ARGS...]" >&2
  exit 2
}

case "${1:-}" in -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
[[ $# -ge 3 ]] || die "expected COORD_HOST:PORT NUM_PROCS PROC_ID, then -- and the command"
coord="$1" num="$2" pid="$3"
shift 3
[[ "${1:-}" == "--" ]] && shift
[[ $# -gt 0 ]] || die "no command given after '--'"

addr_re='^(\[[0-9A-Fa-f:.]+\]|[^]:[]+):([0-9]+)$'
[[ "$coord" =~ $addr_re ]] || die "coordinator must be HOST:PORT, got '$coord'"
port="$((10#${BASH_REMATCH[2]}))"
[[ "$port" -ge 1 && "$port" -le 65535 ]] || die "coordinator port must be in 1..65535, got '$port'"
[[ "$num" =~ ^[0-9]+$ && "$((10#$num))" -ge 1 ]] || die "NUM_PROCS must be a positive integer, got '$num'"
[[ "$pid" =~ ^[0-9]+$ ]] || die "PROC_ID must be a non-negative integer, got '$pid'"
num="$((10#$num))" pid="$((10#$pid))"
[[ "$pid" -lt "$num" ]] || die "PROC_ID must be in 0..$((num - 1)) for $num processes, got '$pid'"

export JETSPEC_COORDINATOR="$coord"
export JETSPEC_NUM_PROCESSES="$num"
export JETSPEC_PROCESS_ID="$pid"
echo "multinode.sh: process $pid of $num on $(hostname), coordinator $coord" >&2
exec "$@"
