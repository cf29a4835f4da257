#!/usr/bin/env bash
# Create (or reuse) .venv and install JetSpec-JAX with its test dependencies (CPU torch pinned to 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q -e ".[test]"
