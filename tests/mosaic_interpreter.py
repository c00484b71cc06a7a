"""Running a Mosaic GPU kernel in Mosaic GPU's interpreter with its race detector on, for the kernels' CPU tests."""

import faulthandler

from pallas_kernels._mosaic import interpret_params

# A fault the interpreter finds (a barrier phase a waiter never observed, a barrier completed twice before it was
# observed) raises in one of the threads it runs the warpgroups on and can leave the others waiting forever.
TIME_LIMIT_S = 300


def run_race_checked(kernel, *args, **kwargs):
    """`kernel(*args, interpret=..., **kwargs)` in the interpreter with the race detector on: fails when a read or
    write of shared memory is not ordered by the barriers after another warpgroup's write. A run that hangs stops
    the process after TIME_LIMIT_S, with its threads' stacks."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    gpu_callbacks.reset_gpu_interpret_mode_state()
    faulthandler.dump_traceback_later(TIME_LIMIT_S, exit=True)
    try:
        out = kernel(*args, interpret=interpret_params(detect_races=True), **kwargs)
        out.block_until_ready()
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert not gpu_callbacks.get_races().races_found, "Mosaic GPU's interpreter found a race (printed above)"
    return out
