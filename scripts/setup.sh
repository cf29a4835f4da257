#!/usr/bin/env bash
# Create (or reuse) .venv and install JetSpec-JAX with its test dependencies (CPU torch pinned to 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q -e ".[test]"
# transformers 4.x beside the venv, for tests/test_hf4_compat.py: a subprocess puts it first on PYTHONPATH
# and takes everything else (torch, numpy, safetensors) from the venv. --no-deps keeps a second torch out;
# the pins are what transformers 4.57 needs that differs from the venv (huggingface_hub < 1, tokenizers <= 0.23.0).
HF4=.venv/transformers4
if [ ! -d "$HF4/transformers-4.57.6.dist-info" ]; then
  rm -rf "$HF4"
  pip install -q --no-deps --target "$HF4" "transformers==4.57.6" "huggingface_hub==0.36.2" "tokenizers==0.22.2"
fi
