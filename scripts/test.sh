#!/usr/bin/env bash
# The test suite (default: everything not marked slow; or the files / pytest arguments given), on 8 fake
# CPU devices, in $TEST_WORKERS processes (default 2; whole files per process, so a module's fixtures
# are built once). XLA's LLVM backend runs at -O0: the suite is mostly compiling small programs, and -O0
# cut compile-bound tests' CPU time by a fifth to a third (an engine test 62 s -> 40 s, the reduced demo's
# build 876 s -> 692 s). Compiled programs persist across runs in one cache that every worker shares
# (tests/conftest.py: $JETSPEC_TEST_CACHE, default ~/.cache/jetspec-jax/tests). The tests pin properties that
# hold under any numerics XLA:CPU gives (other CPU kinds, threads, fast math), which -O0 is one more of.
# An XLA_FLAGS of your own replaces these.
set -euo pipefail
cd "$(dirname "$0")/.."
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0}"
export JAX_PLATFORMS=cpu
# --durations: the slowest tests of the run, to keep the stages within their budgets (docs/development.md).
python -m pytest -q -m "not slow" -n "${TEST_WORKERS:-2}" --dist loadfile --durations=25 "${@:-tests}"
