#!/usr/bin/env bash
# Set up a virtual environment (once) and run the test suite (CPU; GPU tests skip without CUDA).
# Installs the dev and hf extras: the transformers integration tests need transformers.
# FUSEDMOE_REQUIRE_HF=1 turns tests/test_hf.py's skip-if-transformers-is-missing into a collection
# error, so that a broken or missing transformers install fails this script (and CI, which runs it)
# instead of passing with the integration tests skipped; a plain `pytest` still skips them.
# Extra arguments go to pytest (e.g. -k oracle).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh dev,hf
export FUSEDMOE_REQUIRE_HF=1
python -m pytest -q "$@"
