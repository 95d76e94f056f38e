#!/usr/bin/env bash
# Set up a virtual environment (once) and run the main job: `fusedmoe demo`.
# Extra arguments go to the demo (e.g. --model deepseek-v3 --tokens 16).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
fusedmoe demo "$@"
