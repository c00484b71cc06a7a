#!/usr/bin/env bash
# .venv-aot: a virtual environment that compiles for an H200 on a machine without a GPU (tools/aot_h200.py). It is
# this machine's Python packages (--system-site-packages) plus the CUDA plugin of the installed jax's version (XLA's
# GPU compiler with Mosaic GPU's and Triton's lowering, about 130 MB) and nvdisasm for --sass; ptxas comes from
# the CUDA toolkit on PATH (CUDA 13 here). Kept out of the project's environment: with the plugin installed, jax
# would look for a GPU at every start.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(python -c "import jax; print(jax.__version__)")
cuda=${JAX_CUDA_MAJOR:-13}
python -m venv --system-site-packages .venv-aot
.venv-aot/bin/pip install -q --no-deps "jax-cuda${cuda}-plugin==$version" "jax-cuda${cuda}-pjrt==$version" \
    "nvidia-cuda-nvdisasm"
echo ".venv-aot: jax $version with its CUDA $cuda plugin; ptxas: $(command -v ptxas || echo 'not on PATH: set PTXAS')"
