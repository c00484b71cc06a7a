"""JAX's persistent compilation cache under the engine's warm-up, on by default.

The engine compiles one executable per bucket and kind (engine.warmup: the largest before it serves, the others in
the background), each a whole model's step, which on a GPU takes seconds to tens of seconds. JAX stores each
compiled executable in the cache directory, keyed by the program, the compile options, the JAX / jaxlib version and
the device kind, and a later process that compiles the same program (same model shapes, dtypes and engine limits)
loads it instead. Nothing else changes: a program not in the cache is compiled as without one. On an H200 the
Nano-30B class was ready to serve 28.3 s after the LLM call cold and 9.2 s from the cache (docs/BENCHMARKS.md,
"Start-up"); the rest of a warm start is tracing and lowering, which the cache keys on.

Where, first match wins:
  * `LLM(..., compilation_cache_dir=DIR)` or `--compilation-cache DIR` on the command line;
  * the environment variable JAXMODELS_COMPILATION_CACHE_DIR;
  * JAX's own setting (`JAX_COMPILATION_CACHE_DIR` or `jax.config`), left as it is, with JAX's threshold (programs
    that compiled in under a second are not stored);
  * `$XDG_CACHE_HOME/jaxmodels/xla` (by default `~/.cache/jaxmodels/xla`).
"off" (or "none") in either of the first two places turns the engine's cache off: JAX's own setting, if any, still
applies. A directory named here replaces JAX's own with a warning. JAX does not evict entries: delete the directory
to reclaim its space (a few MB per model and limits on the GPU).
"""

import logging
import os

import jax

log = logging.getLogger("jaxmodels")

ENV = "JAXMODELS_COMPILATION_CACHE_DIR"
OFF = ("off", "none")


def default_directory() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "jaxmodels", "xla")


def use_compilation_cache(directory: str | os.PathLike | None = None) -> str | None:
    """Store the executables compiled from now on in the cache directory chosen as the module docstring says, and
    load them from there when compiled before; -> the directory in use (None: no cache)."""
    chosen = directory or os.environ.get(ENV) or None
    current = jax.config.jax_compilation_cache_dir
    if chosen is not None and os.fspath(chosen).strip().lower() in OFF:
        return current
    if chosen is None:
        if current:
            return current
        chosen = default_directory()
    chosen = os.path.abspath(os.path.expanduser(os.fspath(chosen)))
    if current and os.path.abspath(current) != chosen:
        log.warning("compilation cache: %s replaces %s (JAX's setting) for the rest of this process", chosen, current)
    try:
        os.makedirs(chosen, exist_ok=True)
    except OSError as error:  # a read-only home, say: serving goes on, compiling every program
        log.warning("compilation cache: cannot use %s (%s); compiling without a cache", chosen, error)
        return current
    jax.config.update("jax_compilation_cache_dir", chosen)
    # Every step program is worth keeping: JAX by default skips those that compiled in under a second (a small
    # model's, the samplers), which would leave a warm start compiling them again.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # JAX decides whether to use a cache at its first compilation; one may have run already (building the model),
    # with no directory set.
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()
    log.info("compilation cache: %s", chosen)
    return chosen
