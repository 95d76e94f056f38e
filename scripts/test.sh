#!/usr/bin/env bash
# Set up a virtual environment (once) and run the test suite (CPU; GPU tests skip without CUDA).
# Installs the dev and hf extras: the transformers integration tests need transformers.
# Extra arguments go to pytest (e.g. -k oracle).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh dev,hf
python -m pytest -q "$@"
