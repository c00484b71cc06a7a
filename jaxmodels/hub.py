"""Hugging Face Hub ids as model paths: `org/name` resolves to its snapshot in the local Hub cache."""

import os
import re

# What serving a checkpoint reads: config, safetensors weights and their index, tokenizer files, chat templates.
# Weights in torch .bin only (old repositories) are left out: download such a repository into a directory yourself.
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja"]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def looks_like_hub_id(path: str) -> bool:
    return bool(_HUB_ID.fullmatch(path)) and ".." not in path


def resolve_model_path(path) -> str:
    """`path` itself when it exists or cannot be a Hub id; otherwise the directory of the Hub model's snapshot.

    The snapshot comes from `huggingface_hub.snapshot_download`, as transformers and vLLM get theirs: the Hub cache
    (HF_HUB_CACHE or HF_HOME) first, downloaded on first use, and cache only under HF_HUB_OFFLINE=1.
    """
    path = os.fspath(path)
    if os.path.exists(path) or not looks_like_hub_id(path):
        return path
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path, allow_patterns=CHECKPOINT_FILES)
    except OSError as e:  # every huggingface_hub lookup error (offline miss, unknown repo, network) is an OSError
        raise FileNotFoundError(f"{path!r} is not a directory, and as a Hugging Face Hub id it did not resolve: "
                                f"{type(e).__name__}: {e}") from e
