"""Skip marks for the Mosaic GPU kernels' tests: jax 0.10 lowers them (for a GPU, from any machine) and interprets
them without clusters, but the compiled kernels run on jax >= 0.11 only
(`pallas_kernels._mosaic.mosaic_kernels_available`)."""

import pytest

from pallas_kernels._mosaic import mosaic_kernels_available, mosaic_lowering_available

needs_mosaic = pytest.mark.skipif(not mosaic_kernels_available(), reason="the Mosaic GPU kernels run on jax >= 0.11")
needs_mosaic_lowering = pytest.mark.skipif(not mosaic_lowering_available(),
                                           reason="this jax has no warp-specialized Mosaic GPU pipelines")
