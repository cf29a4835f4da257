#!/usr/bin/env bash
# Start N processes of one command on this machine, as one multi-process JAX job.
#
#   launch/local.sh [-n N] [--cpu-devices D] [--gpus-per-proc G] [--port PORT] [--no-prefix] -- CMD [ARGS...]
#
# Process i gets JETSPEC_COORDINATOR=127.0.0.1:PORT, JETSPEC_NUM_PROCESSES=N, JETSPEC_PROCESS_ID=i,
# which jetspec_jax.distributed.initialize() reads. --cpu-devices D gives each process D fake CPU
# devices (JAX_PLATFORMS=cpu, XLA_FLAGS+=--xla_force_host_platform_device_count=D); --gpus-per-proc G
# gives process i the GPUs i*G .. i*G+G-1 through CUDA_VISIBLE_DEVICES. Output lines are prefixed
# with "[i] ". Waits for all; if one fails, the others are stopped (SIGTERM, then SIGKILL after
# $JETSPEC_KILL_GRACE seconds, default 5) and the script exits with the first failing status.
set -uo pipefail

usage() {
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
}

die() {
  echo "local.sh: $*" >&2
  exit 2
}

is_uint() { [[ "$1" =~ ^[0-9]+$ ]] && [[ "${#1}" -le 9 ]]; }

num=2
cpu_devices=""
gpus_per_proc=""
port="${JETSPEC_COORDINATOR_PORT:-}"
prefix=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n|--num-processes) [[ $# -ge 2 ]] || die "$1 needs a value"; num="$2"; shift 2 ;;
    --cpu-devices) [[ $# -ge 2 ]] || die "$1 needs a value"; cpu_devices="$2"; shift 2 ;;
    --gpus-per-proc) [[ $# -ge 2 ]] || die "$1 needs a value"; gpus_per_proc="$2"; shift 2 ;;
    --port) [[ $# -ge 2 ]] || die "$1 needs a value"; port="$2"; shift 2 ;;
    --no-prefix) prefix=0; shift ;;
    -h|--help) usage ;;
    --) shift; break ;;
    *) die "unknown option '$1' (the command goes after '--')" ;;
  esac
done
[[ $# -gt 0 ]] || die "no command given; usage: launch/local.sh [-n N] [--cpu-devices D] -- CMD [ARGS...]"
{ is_uint "$num" && [[ "$((10#$num))" -ge 1 ]]; } || die "-n must be a positive integer, got '$num'"
[[ -z "$cpu_devices" ]] || { is_uint "$cpu_devices" && [[ "$((10#$cpu_devices))" -ge 1 ]]; } \
  || die "--cpu-devices must be a positive integer, got '$cpu_devices'"
[[ -z "$gpus_per_proc" ]] || { is_uint "$gpus_per_proc" && [[ "$((10#$gpus_per_proc))" -ge 1 ]]; } \
  || die "--gpus-per-proc must be a positive integer, got '$gpus_per_proc'"
if [[ -z "$port" ]]; then
  # A free port from the OS; 12355 if no Python is on PATH.
  port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' \
    2>/dev/null || python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' \
    2>/dev/null || echo 12355)"
fi
{ is_uint "$port" && [[ "$((10#$port))" -ge 1 && "$((10#$port))" -le 65535 ]]; } || die "--port must be in 1..65535, got '$port'"
num="$((10#$num))" port="$((10#$port))"
[[ -z "$cpu_devices" ]] || cpu_devices="$((10#$cpu_devices))"
[[ -z "$gpus_per_proc" ]] || gpus_per_proc="$((10#$gpus_per_proc))"
grace="${JETSPEC_KILL_GRACE:-5}"
is_uint "$grace" || die "JETSPEC_KILL_GRACE must be a whole number of seconds, got '$grace'"
grace="$((10#$grace))"

base_xla_flags="$(printf '%s' "${XLA_FLAGS:-}" | sed -E 's/--xla_force_host_platform_device_count=[^ ]*//g; s/^ +//; s/ +$//')"

pids=()
alive=()

stop_all() {
  local i
  for i in "${!pids[@]}"; do
    [[ "${alive[$i]}" == 1 ]] && kill -TERM "${pids[$i]}" 2>/dev/null
  done
  local waited=0
  while [[ "$waited" -lt $((grace * 10)) ]]; do
    local any=0
    for i in "${!pids[@]}"; do
      if [[ "${alive[$i]}" == 1 ]] && kill -0 "${pids[$i]}" 2>/dev/null; then any=1; fi
    done
    [[ "$any" == 1 ]] || break
    sleep 0.1
    waited=$((waited + 1))
  done
  for i in "${!pids[@]}"; do
    [[ "${alive[$i]}" == 1 ]] && kill -KILL "${pids[$i]}" 2>/dev/null
  done
}

# shellcheck disable=SC2317  # invoked by the trap below
on_signal() {
  echo "local.sh: interrupted; stopping all processes" >&2
  stop_all
  exit 130
}
trap on_signal INT TERM HUP

echo "local.sh: $num process(es), coordinator 127.0.0.1:$port${cpu_devices:+, $cpu_devices CPU device(s) each}" >&2
for ((i = 0; i < num; i++)); do
  (
    export JETSPEC_COORDINATOR="127.0.0.1:$port"
    export JETSPEC_NUM_PROCESSES="$num"
    export JETSPEC_PROCESS_ID="$i"
    if [[ -n "$cpu_devices" ]]; then
      export JAX_PLATFORMS=cpu
      export XLA_FLAGS="${base_xla_flags:+$base_xla_flags }--xla_force_host_platform_device_count=$cpu_devices"
    fi
    if [[ -n "$gpus_per_proc" ]]; then
      CUDA_VISIBLE_DEVICES="$(seq -s, $((i * gpus_per_proc)) $((i * gpus_per_proc + gpus_per_proc - 1)))"
      export CUDA_VISIBLE_DEVICES
    fi
    if [[ "$prefix" == 1 ]]; then
      exec "$@" > >(awk -v p="[$i] " '{ print p $0; fflush() }') 2> >(awk -v p="[$i] " '{ print p $0; fflush() }' >&2)
    else
      exec "$@"
    fi
  ) &
  pids+=("$!")
  alive+=(1)
done

status=0
remaining="$num"
while [[ "$remaining" -gt 0 ]]; do
  for i in "${!pids[@]}"; do
    [[ "${alive[$i]}" == 1 ]] || continue
    kill -0 "${pids[$i]}" 2>/dev/null && continue
    wait "${pids[$i]}"
    rc=$?
    alive[i]=0
    remaining=$((remaining - 1))
    if [[ "$rc" -ne 0 && "$status" -eq 0 ]]; then
      status="$rc"
      echo "local.sh: process $i exited with status $rc; stopping the others" >&2
      stop_all
    fi
  done
  [[ "$remaining" -gt 0 ]] && sleep 0.2
done
# Let the output filters drain before returning.
wait 2>/dev/null
if [[ "$status" -eq 0 ]]; then
  echo "local.sh: all $num process(es) finished" >&2
fi
exit "$status"
