#!/usr/bin/env bash
# The main job on its embedded default: set up (if needed) and run `jetspec-jax demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/jetspec-jax demo "$@"
