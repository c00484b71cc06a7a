"""Running a Mosaic GPU kernel in Mosaic GPU's interpreter with its race detector on, for the kernels' CPU tests."""

import contextlib
import faulthandler

from pallas_kernels._mosaic import interpret_params

# A fault the interpreter finds (a barrier phase a waiter never observed, a barrier completed twice before it was
# observed) raises in one of the threads it runs the warpgroups on and can leave the others waiting forever.
TIME_LIMIT_S = 300


@contextlib.contextmanager
def stopped_if_hung(seconds: float = TIME_LIMIT_S):
    """Stops the process, with its threads' stacks, if the block takes longer than `seconds`: a kernel whose
    barriers deadlock (in the interpreter, or compiled on the GPU) would otherwise hold the test run forever. Under
    xdist the worker dies and its test fails; the others go on."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_race_checked(kernel, *args, **kwargs):
    """`kernel(*args, interpret=..., **kwargs)` in the interpreter with the race detector on: fails when a read or
    write of shared memory is not ordered by the barriers after another warpgroup's write. A run that hangs stops
    the process after TIME_LIMIT_S (`stopped_if_hung`)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    gpu_callbacks.reset_gpu_interpret_mode_state()
    with stopped_if_hung():
        out = kernel(*args, interpret=interpret_params(detect_races=True), **kwargs)
        out.block_until_ready()
    assert not gpu_callbacks.get_races().races_found, "Mosaic GPU's interpreter found a race (printed above)"
    return out
