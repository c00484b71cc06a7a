"""JAX's persistent compilation cache under the engine's warm-up.

The engine compiles one executable per bucket and kind before it serves (engine.runner): with the default limits
about fifty programs, each a whole model's step, which on a GPU takes minutes for a large model. With a cache
directory, JAX stores each compiled executable there, keyed by the program, the compile options, the JAX / jaxlib
version and the device kind, and a later process that compiles the same program (same model shapes, dtypes and
engine limits) loads it instead. Nothing else changes: a program not in the cache is compiled as without one.

`LLM(..., compilation_cache_dir=DIR)`, `--compilation-cache DIR` on the command line, or the environment variable
JAXMODELS_COMPILATION_CACHE_DIR. JAX's own `JAX_COMPILATION_CACHE_DIR` works as well (then JAX's threshold applies:
programs that compiled in under a second are not stored); a directory given here takes its place.
"""

import logging
import os

import jax

log = logging.getLogger("jaxmodels")

ENV = "JAXMODELS_COMPILATION_CACHE_DIR"


def use_compilation_cache(directory: str | os.PathLike | None = None) -> str | None:
    """Store the executables compiled from now on in `directory` (or $JAXMODELS_COMPILATION_CACHE_DIR) and load
    them from there when compiled before; -> the cache directory in use (None: no cache). Without a directory,
    leaves JAX's configuration as it is."""
    directory = directory or os.environ.get(ENV) or None
    current = jax.config.jax_compilation_cache_dir
    if directory is None:
        return current
    directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    if current and os.path.abspath(current) != directory:
        log.warning("compilation cache: %s replaces %s (JAX's setting) for the rest of this process", directory,
                    current)
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    # Every step program is worth keeping: JAX by default skips those that compiled in under a second (a small
    # model's, the samplers), which would leave a warm start compiling them again.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # JAX decides whether to use a cache at its first compilation; one may have run already (building the model),
    # with no directory set.
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()
    log.info("compilation cache: %s", directory)
    return directory
