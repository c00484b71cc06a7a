"""Run a module or a script with constants of one module set first (a kernel's variant, in the process that times
it): the lab's way to run an engine or a benchmark on a setting that is not the default.

    python3 bench/lab/with_constants.py pallas_kernels.sparse_mla_mosaic SCHEDULE=seesaw -- -m jaxmodels bench ...
    python3 bench/lab/with_constants.py pallas_kernels.fp8_matmul_mosaic FENCE_STEP_READS=True -- \\
        bench/fp8_kernels.py --only dense

Each NAME=VALUE (several may share an argument, ',' between) is read as `tools/aot_h200.py --set` reads it: a Python
literal, else a string; a name the module lacks is an error. None at all runs the target unchanged. After `--`:
`-m MODULE ARGS` as `python3 -m` runs it, or `SCRIPT ARGS` as `python3 SCRIPT` does (its folder first on the path).
"""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv):
    split = argv.index("--")
    (module, *settings), target = argv[:split], argv[split + 1:]
    sys.path.insert(0, str(ROOT))
    from tools.aot_h200 import set_constants

    set_constants(module, [pair for setting in settings for pair in setting.split(",") if pair])
    if target[0] == "-m":
        sys.argv = target[1:]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = target
        sys.path.insert(0, str(Path(target[0]).resolve().parent))
        runpy.run_path(target[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
