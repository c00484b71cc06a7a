#!/usr/bin/env bash
# Wheels for the packages the GPU machine lacks (it has no network): the server and its tests (fastapi, uvicorn,
# openai and what they need beyond that machine's image) and structured output (llguidance, jsonschema). Run here,
# where pip reaches PyPI; it fills .whl/ (ignored by git) with the versions installed here, which the CPU suite
# runs, built for the GPU machine's Python 3.12. A device call then names .whl in `carry`, and tools/gpu_check.sh
# installs from it whatever is missing there.
#
#   bash tools/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# The image already holds httpx, httpcore, h11, anyio (maybe older than openai's floor, so carried), click, jinja2,
# prometheus-client, attrs and annotated-doc (KINDS.md's package list).
packages=(fastapi starlette uvicorn pydantic pydantic_core typing-inspection annotated-types typing_extensions
          opentelemetry-api openai httpx2 httpcore2 truststore jiter sniffio anyio
          llguidance jsonschema jsonschema-specifications referencing rpds-py)
pins=()
for name in "${packages[@]}"; do
    version=$(python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") \
        || { echo "$name is not installed here: pip install -e '.[torch,test]' first" >&2; exit 1; }
    pins+=("$name==$version")
done
platforms=()
for tag in manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${pins[@]}"
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1), in .whl/"
