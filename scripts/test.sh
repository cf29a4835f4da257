#!/usr/bin/env bash
# The test suite (default: everything not marked slow; or the files / pytest arguments given), on 8 fake
# CPU devices, in $TEST_WORKERS processes (default 2; whole files per process, so a module's fixtures
# are built once).
set -euo pipefail
cd "$(dirname "$0")/.."
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
export JAX_PLATFORMS=cpu
python -m pytest -q -m "not slow" -n "${TEST_WORKERS:-2}" --dist loadfile "${@:-tests}"
