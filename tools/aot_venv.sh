#!/usr/bin/env bash
# .venv-aot: a virtual environment that compiles for an H200 on a machine without a GPU (tools/aot_h200.py). It is
# this machine's Python packages (--system-site-packages) plus the CUDA plugin of the installed jax's version (XLA's
# GPU compiler with Mosaic GPU's and Triton's lowering, about 130 MB) and nvdisasm for --sass; ptxas comes from
# the CUDA toolkit on PATH (CUDA 13 here). Kept out of the project's environment: with the plugin installed, jax
# would look for a GPU at every start.
#
# AOT_JAX=0.11.2 AOT_PYTHON=python3.12 bash tools/aot_venv.sh makes .venv-aot-0.11.2 instead: that jax (the GPU
# machine's, which needs Python 3.12; pyenv has one here) with its plugin, alone in a venv of AOT_PYTHON. The
# lowering is jax's own, so a kernel can lower on one version and not on the other (4adfa68's seesaw did not on
# 0.11.2): check both before a device call.
set -euo pipefail
cd "$(dirname "$0")/.."
cuda=${JAX_CUDA_MAJOR:-13}
if [ -n "${AOT_JAX:-}" ]; then
  version=$AOT_JAX venv=.venv-aot-$AOT_JAX
  "${AOT_PYTHON:-python3.12}" -m venv "$venv"
  "$venv/bin/pip" install -q "jax==$version" "jaxlib==$version"
else
  version=$(python -c "import jax; print(jax.__version__)") venv=.venv-aot
  python -m venv --system-site-packages "$venv"
fi
"$venv/bin/pip" install -q --no-deps "jax-cuda${cuda}-plugin==$version" "jax-cuda${cuda}-pjrt==$version" \
    "nvidia-cuda-nvdisasm"
echo "$venv: jax $version with its CUDA $cuda plugin; ptxas: $(command -v ptxas || echo 'not on PATH: set PTXAS')"
