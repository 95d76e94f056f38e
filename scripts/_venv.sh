# Sourced by demo.sh / test.sh: create .venv if needed and install fusedmoe into it.
# torch is installed first and pinned to the CPU-capable 2.13.0 unless one is already present,
# so that pip does not pull a multi-GB CUDA build on machines without a GPU.
extra="${1:-}"
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
stamp=".venv/.fusedmoe-installed${extra:+-${extra//,/-}}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip >/dev/null
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".${extra:+[$extra]}"
  touch "$stamp"
fi
