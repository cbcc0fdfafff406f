"""Generate argparse flags from config dataclasses and build configs back from parsed flags; upstream's
names for both (`gen_parser_from_dataclass`, `convert_namespace_to_omegaconf`)."""

import argparse
import ast
import dataclasses
import typing
from typing import Any, Literal, Optional, get_args, get_origin

from fairseq.dataclass.build import component_config, convert_namespace_to_config
from fairseq.dataclass.fields import unwrap_optional


def _list_parser(item_type):
    def parse(text: str):
        text = text.strip()
        if text.startswith(("[", "(")):  # upstream also accepts a Python literal
            value = ast.literal_eval(text)
            value = value if isinstance(value, (list, tuple)) else [value]
            return [item_type(v) for v in value]
        return [item_type(v) for v in text.split(",") if v.strip()]

    parse.__name__ = f"list of {item_type.__name__}"
    return parse


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_dataclass_to_parser(
    parser, dc, suppress_defaults: bool = False, positional=("data",), prefix: Optional[str] = None
):
    """Add one flag per field of dataclass `dc` to `parser` (an ArgumentParser or argument group).

    Flags that the parser already has are skipped, so a field shared by two groups is one flag.
    With `suppress_defaults`, unset flags stay absent from the namespace (so architecture presets can
    tell what the user set). A field that is itself a dataclass adds its fields (upstream's rule): flat, or
    with a `prefix` ("--encoder") under `<prefix>-<field>` names (dest `encoder_<field>`; none positional).
    """
    hints = typing.get_type_hints(dc)
    for f in dataclasses.fields(dc):
        if f.name.startswith("_"):
            continue
        name = flag_name(f.name) if not prefix else f"{prefix}-{f.name.replace('_', '-')}"
        dest = f.name if not prefix else name[2:].replace("-", "_")
        if dataclasses.is_dataclass(hints[f.name]):
            add_dataclass_to_parser(
                parser, hints[f.name], suppress_defaults, positional, prefix=name if prefix is not None else None
            )
            continue
        if name in parser._option_string_actions:
            continue
        if "interpolate" in f.metadata or (isinstance(f.default, str) and f.default.startswith("${")):
            continue  # II("group.key"): a value another group's flag sets
        tp, optional = unwrap_optional(hints[f.name])
        kwargs = {"help": f.metadata.get("help", "")}
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )
        if f.name in positional and not prefix:
            parser.add_argument(f.name, nargs="?", default=default, help=kwargs["help"])
            continue
        origin = get_origin(tp)
        if tp is bool:
            kwargs["action"] = "store_true"
        elif origin is Literal:
            kwargs["choices"] = list(get_args(tp))
            kwargs["type"] = type(get_args(tp)[0])
        elif origin in (list, typing.List):
            (item,) = get_args(tp)
            kwargs["type"] = _list_parser(item)
        elif tp in (int, float, str):
            kwargs["type"] = tp
        else:
            kwargs["type"] = str
        if default is not None and not isinstance(default, bool):
            kwargs["help"] += f" (default: {default})"
        kwargs["default"] = argparse.SUPPRESS if suppress_defaults else default
        if "const" in f.metadata:  # the flag alone means this value (upstream's --remove-bpe)
            kwargs.update(nargs="?", const=f.metadata["const"])
        names = [name] + list(f.metadata.get("aliases", []))
        parser.add_argument(*names, dest=dest, **kwargs)


def config_from_namespace(dc, args: argparse.Namespace, name: Optional[str] = None):
    """Instantiate dataclass `dc` from the namespace's attributes named as its own fields (defaults elsewhere;
    `II(...)` fields keep their interpolation, which `build_config` resolves)."""
    return component_config(dc, vars(args), name)


def config_to_dict(cfg) -> Any:
    """Plain nested dict of a config (keeps `_name`), safe for `torch.load(weights_only=True)`."""
    if dataclasses.is_dataclass(cfg):
        out = {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
        if "_name" in vars(cfg):  # set on the instance by whoever named the component (component_config, ...)
            out["_name"] = cfg._name
        return out
    if isinstance(cfg, argparse.Namespace):  # a legacy component's config (upstream's argparse namespace)
        return {k: config_to_dict(v) for k, v in vars(cfg).items()}
    if isinstance(cfg, (list, tuple)):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    return cfg


def config_from_dict(dc, values: dict, name: Optional[str] = None):
    """Inverse of config_to_dict for one flat component config; unknown keys are ignored. A legacy component's
    (`dc` None: configured by `add_args`) is the argparse namespace of all the values."""
    if dc is None:
        cfg = argparse.Namespace(**values)
        if name is not None:
            cfg._name = name
        return cfg
    names = {f.name for f in dataclasses.fields(dc) if f.init}
    cfg = dc(**{k: v for k, v in values.items() if k in names})
    name = name or values.get("_name")
    if name is not None:
        cfg._name = name
    return cfg


# ----------------------------------------------------------------------------- upstream's names


def gen_parser_from_dataclass(
    parser, dataclass_instance, delete_default: bool = False, with_prefix: Optional[str] = None
) -> None:
    """Upstream's name for `add_dataclass_to_parser` (plug-ins' `add_args`): one flag per field of the
    instance's dataclass, nested dataclass fields flattened. `delete_default` leaves unset flags out of the
    namespace; `with_prefix` (upstream's) names nested fields `<prefix>-<field>-<subfield>` ("" at the root:
    `--encoder-layers` for field `layers` of field `encoder`)."""
    dc = dataclass_instance if isinstance(dataclass_instance, type) else type(dataclass_instance)
    add_dataclass_to_parser(parser, dc, suppress_defaults=delete_default, prefix=with_prefix)


def convert_namespace_to_omegaconf(args: argparse.Namespace):
    """Upstream's name for `fairseq.options.convert_namespace_to_config` (defined in fairseq.dataclass.build): the
    typed FairseqConfig (dataclass groups `common`, `dataset`, ..., `task`, `model`, ...) that this fork's code
    takes, not an omegaconf DictConfig. Attribute access (`cfg.dataset.max_tokens`) is the same; to get a
    DictConfig, pass it to `omegaconf.OmegaConf.structured`."""
    return convert_namespace_to_config(args)
