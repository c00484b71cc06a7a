#!/usr/bin/env bash
# On the GPU machine: install from the wheels carried in .whl/ (tools/gpu_wheels.sh) the packages named, or by
# default those of the server, its tests and structured output, where they are missing. pip resolves against what
# the machine holds, taking from .whl/ only what is absent or too old. Without .whl/ it does nothing: the tests
# that need those packages then skip (tests/serve/conftest.py).
#
#   bash tools/install_wheels.sh [PACKAGE...]
cd "$(dirname "$0")/.."
[ -d .whl ] || { echo "no .whl/ carried: the server's tests will skip"; exit 0; }
packages=("$@")
[ ${#packages[@]} -eq 0 ] && packages=(fastapi uvicorn openai llguidance jsonschema)
missing=()
for name in "${packages[@]}"; do
    python3 -c "import $name" 2>/dev/null || missing+=("$name")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing from .whl/: ${missing[*]}"
python3 -m pip install -q --no-index --find-links .whl "${missing[@]}" 2>&1 | grep -v "^WARNING" | tail -3
