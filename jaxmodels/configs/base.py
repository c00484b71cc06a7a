"""Helpers shared by the model configs: reading `config.json`, field validation with named errors."""

import json
import math
import os


class ConfigError(ValueError):
    """A config field is missing or invalid; `field` names it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"config field {field!r}: {message}")


def read_config_dict(source) -> dict:
    """Parse `source`: a dict, a path to `config.json`, or a checkpoint directory holding one."""
    if isinstance(source, dict):
        return dict(source)
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
        return json.load(f, parse_constant=_parse_constant, object_hook=_decode_special_floats)


def _parse_constant(name: str) -> float:
    return {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}[name]


def _decode_special_floats(obj: dict):
    # transformers >= 5 writes non-finite floats as {"__float__": "Infinity"}.
    if set(obj) == {"__float__"}:
        return float(obj["__float__"])
    return obj


def pop_alias(raw: dict, canonical: str, *legacy: str, default=None):
    """Value of `canonical` in `raw`, falling back to the legacy names (first present wins)."""
    for name in (canonical, *legacy):
        if name in raw and raw[name] is not None:
            return raw[name]
    return default


def eos_token_ids(raw: dict) -> tuple[int, ...]:
    """`eos_token_id` as a tuple: HF writes one id, a list of ids, or nothing (`None` or absent -> `()`)."""
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, (list, tuple)):
        return tuple(eos)
    return (int(eos),)


def require_positive(cfg, *fields: str) -> None:
    for name in fields:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(name, f"must be a positive integer, got {value!r}")


def require_divisible(cfg, numerator: str, denominator: str) -> None:
    a, b = getattr(cfg, numerator), getattr(cfg, denominator)
    if a % b:
        raise ConfigError(numerator, f"{numerator}={a} is not divisible by {denominator}={b}")
