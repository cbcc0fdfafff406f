"""Upstream's legacy components: `--user-dir` plug-ins written before dataclass configs.

Such a component is registered without a dataclass, declares its flags in `add_args(parser)`, and is configured
by the parsed argparse namespace itself. A model's architectures are functions that fill the namespace's unset
attributes (`args.x = getattr(args, "x", 3)`). Upstream's rules, kept here:
- the model's `add_args` flags are added with argparse.SUPPRESS as the default of their group, so a flag left
  unset is absent and the architecture function can fill it (a flag declared with `default=` is present);
- the component's config is a copy of the whole namespace (`cfg.model.dropout`, `cfg.model.tokens_per_sample`:
  legacy plug-ins read options of every group from it), with the defaults its `add_args` declares for keys still
  missing (upstream's `_set_legacy_defaults`) and `_name` set to the component's (architecture's) name.
"""

import argparse
import dataclasses
from typing import Any, Dict, Mapping, Optional

from fairseq import registry


def is_legacy_arch(arch: str) -> bool:
    """True when `--arch ARCH`'s model was registered without a dataclass (raises for an unknown ARCH)."""
    return registry.dataclass_of(registry.arch_model(arch)) is None


def add_model_args(parser, model_cls) -> None:
    """Add a legacy model's `add_args` flags to `parser` in one group whose unset flags stay absent."""
    group = parser.add_argument_group("model-specific configuration", argument_default=argparse.SUPPRESS)
    if hasattr(model_cls, "add_args"):
        model_cls.add_args(group)


def declared_defaults(cls) -> Dict[str, Any]:
    """The defaults `cls.add_args` declares explicitly, by dest (flags declared without one have none)."""
    if not hasattr(cls, "add_args"):
        return {}
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS, allow_abbrev=False, add_help=False)
    cls.add_args(parser)
    defaults: Dict[str, Any] = {}
    for action in parser._actions:
        if action.dest != argparse.SUPPRESS and action.default is not argparse.SUPPRESS:
            defaults.setdefault(action.dest, action.default)
    return defaults


def declared_options(cls) -> Dict[str, argparse.Action]:
    """The options `cls.add_args` declares, by dest: what a YAML config may set for a legacy component."""
    if not hasattr(cls, "add_args"):
        return {}
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS, allow_abbrev=False, add_help=False)
    cls.add_args(parser)
    return {a.dest: a for a in parser._actions if a.dest != argparse.SUPPRESS}


def coerce_option(where: str, action: argparse.Action, value: Any) -> Any:
    """A YAML value for a legacy option, checked as its flag would be: YAML gives typed values, so a value is
    converted by the flag's `type` only when it is a string (or a list of them); ValueError names `where`."""
    flag = action.option_strings[0] if action.option_strings else action.dest
    if action.nargs == 0:  # store_true / store_false / store_const: YAML writes the resulting value
        if action.const in (True, False) and not isinstance(value, bool):
            raise ValueError(f"{where}={value!r}: {flag} is a switch; write true or false")
        return value

    def one(item):
        if action.type is not None and isinstance(item, str) and action.type is not str:
            try:
                item = action.type(item)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                raise ValueError(f"{where}={item!r}: not a valid value for {flag} ({e})") from None
        elif action.type in (int, float) and (isinstance(item, bool) or not isinstance(item, (int, float))):
            raise ValueError(f"{where}={item!r}: {flag} takes a number")
        elif action.type is int and isinstance(item, float):
            if not item.is_integer():
                raise ValueError(f"{where}={item!r}: {flag} takes an integer")
            item = int(item)  # YAML reads 1e8 as a float
        elif action.type is float and isinstance(item, int):
            item = float(item)
        if action.choices is not None and item not in action.choices:
            raise ValueError(
                f"{where}={item!r} is not a valid choice for {flag}; choose one of: "
                f"{', '.join(map(str, action.choices))}"
            )
        return item

    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        return [one(item) for item in (value if isinstance(value, (list, tuple)) else [value])]
    return one(value)


def legacy_config(cls, values: Mapping[str, Any], name: str) -> argparse.Namespace:
    """The config of legacy component `cls` registered as `name`: the flat option values as a namespace."""
    config = argparse.Namespace(**{k: v for k, v in values.items() if k != "_name"})
    for key, value in declared_defaults(cls).items():
        if not hasattr(config, key):
            setattr(config, key, value)
    config._name = name
    return config


def legacy_model_config(arch: str, values: Mapping[str, Any]) -> argparse.Namespace:
    """The model config of `--arch ARCH` (a legacy model): the namespace after the architecture function.

    A plug-in that extends a dataclass model (a wrapper of this fork's transformer_lm, say) gets that
    dataclass's defaults for the fields still missing: upstream's transformer_lm filled them when it was built
    (its build_model ran base_lm_architecture), this fork's reads them from its config."""
    model_cls = registry.arch_model(arch)
    config = legacy_config(model_cls, values, arch)
    config.arch = arch
    registry.ARCH_CONFIG_REGISTRY[arch](config)
    inherited = inherited_dataclass(model_cls)
    if inherited is not None:
        defaults = inherited()
        for f in dataclasses.fields(inherited):
            if not f.name.startswith("_") and not hasattr(config, f.name):
                setattr(config, f.name, getattr(defaults, f.name))
    return config


def inherited_dataclass(model_cls) -> Optional[type]:
    """The config dataclass of the nearest base class of `model_cls` registered with one (None: none)."""
    for base in model_cls.__mro__[1:]:
        dc = base.__dict__.get("config_class")
        if dc is not None:
            return dc
    return None
