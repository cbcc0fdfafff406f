"""The two field helpers every config dataclass is written with (`opt`, `II`), below configs.py and
generation.py, which both use them, so neither has to import the other to define its fields; and
`unwrap_optional`, which the flag generator and the config builder both read field types with."""

import types
from dataclasses import field
from typing import Union, get_args, get_origin


def opt(default=None, help: str = "", **metadata):
    """A config field with its help text; list defaults are copied per instance."""
    metadata["help"] = help
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=metadata)
    return field(default=default, metadata=metadata)


def II(key: str, default=None):
    """A field whose value is another group's option `key` ("group.name"), as upstream's `II(...)` fields are:
    no flag of its own; building the config copies the owner's value. `default` (the owner's default) is what a
    dataclass built directly, outside a config, holds."""
    return field(default=default, metadata={"interpolate": key, "help": f"the value of {key}"})


def unwrap_optional(tp):
    """Optional[X] -> (X, True); X -> (X, False)."""
    if get_origin(tp) in (Union, getattr(types, "UnionType", Union)):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False
