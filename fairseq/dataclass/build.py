"""The one place a typed FairseqConfig is built: from `fairseq-train`'s parsed flags and from a YAML file alike.

fairseq's options form one namespace: `--seed` is one flag whichever groups mention a seed. So the input is a
flat mapping, option name -> value, holding what the user set (and, from argparse, the defaults of the flags it
added). Each option has one owner, the dataclass that declares it as a plain field; another dataclass that needs
the value declares the field as `II("owner.key")` (upstream's convention), which is no flag of its own and is
copied from the owner once every group is built. The architecture preset (`--arch`) fills the model fields the
user left unset, on a namespace of the model's fields only (upstream's preset interface).
"""

import argparse
import dataclasses
import re
import typing
from typing import Any, Dict, Mapping, Optional

from fairseq import registry
from fairseq.dataclass import configs, legacy
from fairseq.dataclass.fields import unwrap_optional

# The plain groups of FairseqConfig (one dataclass each, always present).
PLAIN_GROUPS = (
    "common",
    "dataset",
    "distributed_training",
    "optimization",
    "checkpoint",
    "eval_lm",
    "common_eval",
    "ema",
)

# The chosen components besides the model (--arch): each is selected by the flag of its own name.
COMPONENTS = ("task", "criterion", "optimizer", "lr_scheduler", "bpe", "tokenizer")

_INTERPOLATION = re.compile(r"^\$\{(\w+)\.(\w+)\}$")


def check_seed(common) -> None:
    """--seed seeds torch and numpy, whose seeds are integers from 0 to 2**32 - 1."""
    seed = getattr(common, "seed", None)
    if seed is not None and not 0 <= seed < 2**32:
        raise ValueError(f"--seed {seed} is out of range: an integer from 0 to 2**32 - 1 (it seeds torch and numpy)")


def check_precision(common) -> None:
    """--fp16 and --bf16 (and their memory_efficient_ spellings) exclude each other."""
    fp16 = getattr(common, "fp16", False) or getattr(common, "memory_efficient_fp16", False)
    bf16 = getattr(common, "bf16", False) or getattr(common, "memory_efficient_bf16", False)
    if fp16 and bf16:
        raise ValueError("--fp16 and --bf16 cannot be combined; pass one of them")


def interpolation_of(f: dataclasses.Field) -> Optional[str]:
    """ "group.key" for a field whose value is another group's option: declared with this project's
    `configs.II(...)`, or defaulting to omegaconf's "${group.key}" string (upstream plug-ins); else None."""
    if "interpolate" in f.metadata:
        return f.metadata["interpolate"]
    match = _INTERPOLATION.match(f.default) if isinstance(f.default, str) else None
    return f"{match.group(1)}.{match.group(2)}" if match else None


def is_interpolated(f: dataclasses.Field) -> bool:
    return interpolation_of(f) is not None


def component_config(dc, values: Mapping[str, Any], name: Optional[str] = None):
    """Dataclass `dc` from the values named as its own (not interpolated) fields; defaults for the rest."""
    kwargs = {
        f.name: values[f.name] for f in dataclasses.fields(dc) if f.init and f.name in values and not is_interpolated(f)
    }
    cfg = dc(**kwargs)
    if name is not None:
        cfg._name = name
    return cfg


def model_config(arch: str, values: Mapping[str, Any], owners: Optional[configs.FairseqConfig] = None):
    """The model config `--arch ARCH` gives with these values set: the preset fills what they leave unset, the
    model dataclass's defaults the rest. `owners` (the config built so far) gives interpolated fields' values
    to the preset, as upstream's presets saw them; they are copied from their owner afterwards anyway. A legacy
    model (no dataclass) gets the namespace of all the values instead (fairseq.dataclass.legacy)."""
    if legacy.is_legacy_arch(arch):  # raises for an unknown --arch
        return legacy.legacy_model_config(arch, values)
    model_dc = registry.dataclass_of(registry.arch_model(arch))
    fields = dataclasses.fields(model_dc)
    preset_args = argparse.Namespace(
        **{f.name: values[f.name] for f in fields if f.name in values and not is_interpolated(f)}
    )
    if owners is not None:
        for f in fields:
            owner_value = _owner_value(owners, f) if is_interpolated(f) else None
            if owner_value is not None:
                setattr(preset_args, f.name, owner_value)
    registry.ARCH_CONFIG_REGISTRY[arch](preset_args)
    return component_config(model_dc, vars(preset_args), arch)


def convert_namespace_to_config(args: argparse.Namespace) -> configs.FairseqConfig:
    """Structured config from parsed flags: one dataclass per group, one per chosen component."""
    values = vars(args)
    components = {attr: values.get(attr) for attr in COMPONENTS}
    components["model"] = values.get("arch")
    return build_config(values, components)


def preset_config(arch: str, model_cls, kind: str, overrides: Mapping[str, Any]):
    """The config `--arch ARCH` of `model_cls` (registered as `kind`) plus `overrides` would produce, without a
    command line (a model module's `preset_config`: tests, the memory planner). The overrides play the part of
    the flags: the preset fills only what they leave unset, the config defaults the rest; a field that copies
    another group's value (II: --criterion, --fp8, the task's --tokens-per-sample, ...) takes the override
    when one is given, else its default."""
    if registry.arch_model(arch) is not model_cls:  # raises for an unknown arch
        raise ValueError(f"--arch {arch} is not a {kind} architecture")
    fields = dataclasses.fields(registry.dataclass_of(model_cls))
    unknown = sorted(set(overrides) - {f.name for f in fields})
    if unknown:
        raise ValueError(f"unknown {kind} option(s): {', '.join(unknown)}")
    cfg = model_config(arch, overrides)
    for f in fields:
        if is_interpolated(f) and f.name in overrides:
            setattr(cfg, f.name, overrides[f.name])
    return cfg


def build_config(values: Mapping[str, Any], components: Mapping[str, Optional[str]]) -> configs.FairseqConfig:
    """FairseqConfig from flat option values and the chosen components ({"task": "language_modeling",
    "model": "transformer_lm_gpt3_small", "criterion": ..., "optimizer": ..., "lr_scheduler": ..., "bpe": ...,
    "tokenizer": ...}; a None or missing entry leaves that component unset)."""
    cfg = configs.FairseqConfig()
    for group in PLAIN_GROUPS:
        setattr(cfg, group, component_config(type(getattr(cfg, group)), values))
    # Upstream's memory-efficient spellings mean the same here. (--fp16 with --bf16 is each front end's check:
    # parse_args_and_arch for the flags, fairseq_config_from_dict for a YAML config.)
    cfg.common.fp16 = cfg.common.fp16 or cfg.common.memory_efficient_fp16
    cfg.common.bf16 = cfg.common.bf16 or cfg.common.memory_efficient_bf16
    legacy_components = []
    for attr, reg in (
        ("task", registry.TASK_REGISTRY),
        ("criterion", registry.CRITERION_REGISTRY),
        ("optimizer", registry.OPTIMIZER_REGISTRY),
        ("lr_scheduler", registry.LR_SCHEDULER_REGISTRY),
        ("bpe", registry.BPE_REGISTRY),
        ("tokenizer", registry.TOKENIZER_REGISTRY),
    ):
        name = components.get(attr)
        if name is not None:
            dc = reg.dataclass(name)
            if dc is None:
                legacy_components.append((attr, reg.get(name), name))
            else:
                setattr(cfg, attr, component_config(dc, values, name))
    # Upstream's legacy components (flags from `add_args`, no dataclass) are given the whole namespace: every
    # option's value, defaults included, as a command line's parsed namespace holds them (a config file names
    # only the values it sets).
    legacy_model = _is_legacy_model(components)
    namespace = _all_option_values(cfg, values, components) if legacy_components or legacy_model else values
    for _, cls, _ in legacy_components:  # their add_args defaults are in a command line's namespace too
        for key, value in legacy.declared_defaults(cls).items():
            namespace.setdefault(key, value)
    if components.get("model") is not None:
        cfg.model = model_config(components["model"], namespace if legacy_model else values, owners=cfg)
        if legacy_model:  # the architecture function ran on the whole namespace, as in parse_args_and_arch
            namespace = {**namespace, **{k: v for k, v in vars(cfg.model).items() if k != "_name"}}
    for attr, cls, name in legacy_components:
        setattr(cfg, attr, legacy.legacy_config(cls, namespace, name))
    resolve_interpolated_defaults(cfg)
    return cfg


def _is_legacy_model(components: Mapping[str, Optional[str]]) -> bool:
    return components.get("model") is not None and legacy.is_legacy_arch(components["model"])


def _all_option_values(
    cfg: configs.FairseqConfig, values: Mapping[str, Any], components: Mapping[str, Optional[str]]
) -> Dict[str, Any]:
    """`values` over the value of every option of the groups and dataclass components built so far, and the
    components' names (`arch`, `task`, `optimizer`, ...), as a parsed command line holds them."""
    namespace: Dict[str, Any] = {"arch": components.get("model")}
    for attr in COMPONENTS:
        namespace[attr] = components.get(attr)
    for attr in PLAIN_GROUPS + COMPONENTS:
        group = getattr(cfg, attr, None)
        if dataclasses.is_dataclass(group):
            for f in dataclasses.fields(group):
                if not f.name.startswith("_"):
                    namespace.setdefault(f.name, getattr(group, f.name))
    namespace.update(values)
    return namespace


def _owner_value(cfg, f: dataclasses.Field):
    group, key = interpolation_of(f).split(".")
    return getattr(getattr(cfg, group, None), key, None)


def resolve_interpolated_defaults(cfg: configs.FairseqConfig) -> None:
    """Copy each interpolated field's value from its owner. An owner that lacks the key (a plug-in task without
    max_target_positions, say) leaves a `configs.II` field at its default and an Optional field None; any
    other field is an error."""
    for section_name in [f.name for f in dataclasses.fields(cfg)]:
        section = getattr(cfg, section_name)
        if not dataclasses.is_dataclass(section):
            continue
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            declared = "interpolate" in f.metadata
            match = _INTERPOLATION.match(value) if isinstance(value, str) else None
            if not declared and match is None:
                continue
            group, key = interpolation_of(f).split(".") if declared else match.groups()
            owner = getattr(cfg, group, None)
            if hasattr(owner, key):
                setattr(section, f.name, getattr(owner, key))
            elif not declared and _is_optional(type(section), f.name):
                setattr(section, f.name, None)
            elif not declared:
                raise ValueError(
                    f"{section_name}.{f.name} defaults to {value}, but there is no option {group}.{key}; "
                    f"set {section_name}.{f.name} in the config, or give the field a plain default"
                )


def _is_optional(dc, name: str) -> bool:
    try:
        hints = typing.get_type_hints(dc)
    except (NameError, TypeError):  # a plug-in's unresolvable annotation
        return False
    return unwrap_optional(hints.get(name, Any))[1]
