#!/usr/bin/env bash
# Create (or reuse) .venv-tpu: JetSpec-JAX with jax[tpu] (jax 0.12 + its libtpu) and pytest, for a Cloud TPU VM
# or for compiling TPU programs on any x86-64 machine without a TPU (bench/aot_memory.py --target v5p-8 ...).
# Needs Python >= 3.12 (jax 0.12): $PYTHON, else python3.12, python3.13 or pyenv's 3.12.1.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-tpu/bin/python ]; then
  py="${PYTHON:-}"
  for candidate in python3.12 python3.13; do
    [ -n "$py" ] && break
    "$candidate" -c "import sys; assert sys.version_info >= (3, 12)" 2>/dev/null && py=$(command -v "$candidate")
  done
  if [ -z "$py" ] && command -v pyenv >/dev/null; then
    PYENV_VERSION=3.12.1 pyenv which python3.12 >/dev/null 2>&1 && py=$(PYENV_VERSION=3.12.1 pyenv which python3.12)
  fi
  [ -n "$py" ] || { echo "setup_tpu.sh: jax 0.12 needs Python 3.12 or newer; set PYTHON=/path/to/python3.12" >&2; exit 1; }
  "$py" -m venv .venv-tpu
fi
. .venv-tpu/bin/activate
pip install -q --upgrade pip
pip install -q -e . "jax[tpu]>=0.12,<0.13" "pytest>=8" "pytest-xdist>=3"
python -c "import jax, libtpu; print('python', __import__('sys').version.split()[0], 'jax', jax.__version__, 'libtpu ready')"
