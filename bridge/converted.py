"""Saving converted params with orbax so that a second load skips the checkpoint conversion.

A converted directory holds `config.json` (the HF config we were built from), `jaxmodels_converted.json` (our
marker: dtype and format version) and `params/` (an orbax checkpoint of {dotted path: array}).
"""

import json
import os
import shutil

import jax.numpy as jnp

MARKER = "jaxmodels_converted.json"
FORMAT_VERSION = 1


def is_converted_dir(path) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), MARKER))


def save_converted(params: dict, directory, raw_config: dict, *, dtype) -> None:
    """Write `params` ({dotted path: array}, converted to `dtype`) and the HF config they were built from to
    `directory` (replacing what is there)."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    params_dir = os.path.join(directory, "params")
    if os.path.exists(params_dir):
        shutil.rmtree(params_dir)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(params_dir, params)
        checkpointer.wait_until_finished()
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(raw_config, f, indent=1)
    with open(os.path.join(directory, MARKER), "w") as f:
        json.dump({"format_version": FORMAT_VERSION, "dtype": jnp.dtype(dtype).name}, f)


def converted_dtype(directory) -> str:
    with open(os.path.join(os.fspath(directory), MARKER)) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{directory}: converted format {meta.get('format_version')} is not {FORMAT_VERSION}; "
                         "convert the HF checkpoint again")
    return meta["dtype"]


def restore_converted(directory, abstract: dict) -> dict:
    """{dotted path: array} restored from `directory`, shaped and typed as `abstract` says."""
    import orbax.checkpoint as ocp

    params_dir = os.path.join(os.path.abspath(os.fspath(directory)), "params")
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(params_dir, abstract)
