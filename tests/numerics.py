"""How far one array is from another: the error measures the tests compare against their tolerances.

Both compute in float64, so that the measure itself adds no rounding to what a bf16 or float32 run is judged on.
"""

import numpy as np


def max_relative_error(ours, theirs) -> float:
    """max |ours - theirs| / max |theirs|: the worst element against the largest reference value.

    The parity tests' measure of logits agreement: one badly wrong logit fails it, however many are right.
    """
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def rms_relative_error(ours, theirs) -> float:
    """||ours - theirs|| / ||theirs|| over all elements, which is RMS(ours - theirs) / RMS(theirs).

    The kernel tests' measure, and the rounding noise of the bf16 parity tests: it averages over elements, so it
    stays near one rounding's size where `max_relative_error` reports the largest of many. An all-zero reference
    is met exactly by an all-zero result (0, not 0/0).
    """
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30))
