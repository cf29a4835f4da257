#!/usr/bin/env bash
# Create (or reuse) .venv-tpu: JetSpec-JAX with jax[tpu] (jax 0.12 + its libtpu) and pytest, for a Cloud TPU VM
# or for compiling TPU programs on any x86-64 machine without a TPU (bench/aot_memory.py --target v5p-8 ...).
# Needs Python >= 3.12 (jax 0.12): $PYTHON, else python3.12, python3.13 or pyenv's 3.12.1.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-tpu/bin/python ]; then
  # Each candidate is resolved to the interpreter itself (sys.executable): a pyenv shim needs PYENV_VERSION.
  resolve() { "$@" -c "import sys; assert sys.version_info >= (3, 12); print(sys.executable)" 2>/dev/null; }
  py=""
  if [ -n "${PYTHON:-}" ]; then
    py=$(resolve "$PYTHON" || PYENV_VERSION=3.12.1 resolve "$PYTHON") \
      || { echo "setup_tpu.sh: PYTHON=$PYTHON is not a Python 3.12 or newer" >&2; exit 1; }
  fi
  for candidate in python3.12 python3.13; do
    [ -n "$py" ] && break
    py=$(resolve "$candidate") || py=""
  done
  if [ -z "$py" ] && command -v pyenv >/dev/null; then
    py=$(PYENV_VERSION=3.12.1 resolve python3.12) || py=""
  fi
  [ -n "$py" ] || { echo "setup_tpu.sh: jax 0.12 needs Python 3.12 or newer; set PYTHON=/path/to/python3.12" >&2; exit 1; }
  "$py" -m venv .venv-tpu
fi
. .venv-tpu/bin/activate
pip install -q --upgrade pip
pip install -q -e . "jax[tpu]>=0.12,<0.13" "pytest>=8" "pytest-xdist>=3"
python -c "import jax, libtpu; print('python', __import__('sys').version.split()[0], 'jax', jax.__version__, 'libtpu ready')"
