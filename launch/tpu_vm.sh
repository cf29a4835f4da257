#!/usr/bin/env bash
# Run one command on every worker (host) of a Cloud TPU VM slice, the same command everywhere.
#
#   launch/tpu_vm.sh [--zone ZONE] [--project PROJECT] [--dir DIR] [--python PY] [--dry-run] TPU_NAME -- CMD [ARGS...]
#
# Each worker cds into DIR (default: jetspec-jax, the checkout every worker holds at the same path), makes or
# reuses .venv-tpu (scripts/setup_tpu.sh: jax[tpu]; PY: a Python >= 3.12 on the workers) and runs CMD from it,
# through `gcloud compute tpus tpu-vm ssh TPU_NAME --worker=all`. jetspec_jax.distributed.initialize() in each
# process then lets jax find the slice's hosts from the TPU VM's metadata: no coordinator to pass.
#   launch/tpu_vm.sh --zone us-east5-a my-v5p-16 -- jetspec-jax train --config configs/qwen3_8b.py ...
# --dry-run prints the gcloud command instead of running it. The exit status is gcloud's.
set -euo pipefail

die() {
  echo "tpu_vm.sh: $*" >&2
  echo "usage: launch/tpu_vm.sh [--zone ZONE] [--project PROJECT] [--dir DIR] [--python PY] [--dry-run] TPU_NAME -- CMD [ARGS...]" >&2
  exit 2
}

zone="" project="" dir="jetspec-jax" python="" dry=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --zone|--project|--dir|--python)
      [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"
      declare "${1#--}=$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --) die "the TPU name comes before '--'" ;;
    -*) die "unknown option '$1'" ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || die "no TPU name given"
name="$1"; shift
[[ "$name" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die "TPU name must be lowercase letters, digits and '-', got '$name'"
[[ "${1:-}" == "--" ]] || die "expected '--' and the command after the TPU name"
shift
[[ $# -gt 0 ]] || die "no command given after '--'"

remote="cd $(printf '%q' "$dir") && ${python:+PYTHON=$(printf '%q' "$python") }bash scripts/setup_tpu.sh && .venv-tpu/bin/$(printf '%q ' "$@")"
cmd=(gcloud compute tpus tpu-vm ssh "$name" --worker=all ${zone:+--zone="$zone"} ${project:+--project="$project"} --command="$remote")
if [[ $dry -eq 1 ]]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
command -v gcloud >/dev/null || die "gcloud is not installed here (https://cloud.google.com/sdk/docs/install)"
exec "${cmd[@]}"
