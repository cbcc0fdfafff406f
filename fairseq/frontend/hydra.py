"""Hydra/YAML configs -> FairseqConfig, the same object `fairseq-train`'s command line produces.

A config is upstream fairseq's yaml layout: the top-level groups `common`, `dataset`,
`distributed_training`, `optimization`, `checkpoint`, and the components `task`, `model`, `criterion`,
`optimizer`, `lr_scheduler`, each a mapping with `_name` (the registered name; for `model`, the
architecture) plus that component's fields:

    task: {_name: language_modeling, data: ???, tokens_per_sample: 2048}
    model: {_name: transformer_lm_gpt3_small, activation_fn: relu}

`fairseq_config_from_dict` checks every key against the dataclasses, then hands the set values, as one flat
mapping (a name several groups hold, such as `seed` or `tokens_per_sample`, is one option and so one value),
to `fairseq.dataclass.build.build_config`, which `fairseq-train`'s flags go through too: the owner of each
option takes its value, the architecture preset fills what is still unset, the defaults fill the rest. A
YAML file and the equivalent `fairseq-train` flags therefore give equal configs.

Upstream's files are read as upstream's hydra 1.0 read them: their `# @package _group_` headers are dropped
(`without_group_package_headers`); `bpe:` and `tokenizer:` choose the text encoders as `--bpe`/`--tokenizer`
do (or are null), and the other groups upstream lists with null defaults (`scoring: null`, ...) are accepted
when null.

Conventions beyond upstream's layout:
- `???` (omegaconf's "missing") marks a value the user must give, e.g. `task.data: ???`. It is an error
  when the chosen component has that field, and is dropped when it does not (so `task._name=dummy_lm`
  needs no data path).
- the top-level `_recipe` mapping is recipe metadata (the GPU count the batch was chosen for, ...), not an
  option; it is returned separately by `split_recipe`.
- `${fairseq.mul:A,B}` multiplies two numbers (e.g. an end learning rate that follows `optimization.lr`;
  a list counts as its first item).
"""

import contextlib
import dataclasses
import os
import re
import shutil
import tempfile
import typing
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, get_args, get_origin

from omegaconf import DictConfig, ListConfig, OmegaConf

from fairseq import registry
from fairseq.frontend import options
from fairseq.dataclass import legacy
from fairseq.dataclass.build import build_config, check_precision
from fairseq.dataclass.configs import FairseqConfig
from fairseq.dataclass.fields import unwrap_optional
from fairseq.dataclass.utils import flag_name
from fairseq.suggest import did_you_mean

MISSING = "???"
RECIPE_KEY = "_recipe"
TRAIN_GROUPS = options.TRAIN_GROUPS  # group name -> dataclass, in the command line's order
COMPONENT_DEFAULTS = {attr: default for attr, _, _, default in options.COMPONENTS}
COMPONENT_REGISTRIES = {attr: reg for attr, _, reg, _ in options.COMPONENTS}
COMPONENTS = ("task", "model", "criterion", "optimizer", "lr_scheduler")
# Chosen or not (null / `{_name: null}`): the text encoders, recorded in the config (and the checkpoint) for
# evaluation and generation, as `fairseq-train --bpe ...` records them.
OPTIONAL_COMPONENTS = ("bpe", "tokenizer")


def _multiply(a, b) -> float:
    """`${fairseq.mul:${optimization.lr},0.1}`; a list stands for its first item (the learning rate fairseq
    uses), so the expression works whether lr is written as [x] or x."""
    a, b = (v[0] if isinstance(v, (list, tuple, ListConfig)) else v for v in (a, b))
    # 12 significant digits: 6e-4 * 0.1 reads 6e-05, not 5.9999999999999995e-05.
    return float(f"{float(a) * float(b):.12g}")


def register_resolvers() -> None:
    """Register `${fairseq.mul:A,B}`; safe to call more than once."""
    if not OmegaConf.has_resolver("fairseq.mul"):
        OmegaConf.register_new_resolver("fairseq.mul", _multiply)


register_resolvers()


# ---------------------------------------------------------------------------------------- overrides


def as_hydra_overrides(overrides: Sequence[str]) -> List[str]:
    """Let `group.key=value` set any key, whether or not the YAML file spells it out.

    Hydra composes in struct mode, where `model.decoder_layers=2` fails unless the file already has that
    key (hydra wants `++model.decoder_layers=2`). Every key is checked against the dataclasses afterwards
    anyway, so plain dotted overrides become `++` ("add or override"). Left alone: overrides with a prefix
    (`+`, `++`, `~`), hydra's own (`hydra.*`), config-group choices (`a/b=c`, `a@p=c`) and undotted keys.
    """
    rewritten = []
    for item in overrides:
        key = item.split("=", 1)[0]
        plain = "=" in item and not item.startswith(("+", "~")) and "." in key
        if plain and not key.startswith("hydra.") and "/" not in key and "@" not in key:
            item = "++" + item
        rewritten.append(item)
    return rewritten


def compose_dict(config_dir: str, config_name: str, overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """Compose `config_dir/config_name.yaml` with `key=value` overrides (hydra's compose API), resolved."""
    from hydra import compose, initialize_config_dir  # deferred: startup (0.2 s, for YAML configs only)

    with without_group_package_headers(os.path.abspath(config_dir)) as readable_dir:
        with initialize_config_dir(config_dir=readable_dir, version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=as_hydra_overrides(overrides))
    return to_plain_dict(cfg)


def to_plain_dict(cfg: DictConfig) -> Dict[str, Any]:
    """Plain nested containers of the keys the config writes, interpolations resolved; missing values stay
    `???`. An interpolation may name an option the config does not write (`${dataset.batch_size}`): as with
    upstream's schema, it resolves to that option's default (for a model field: the model dataclass's default,
    not the architecture preset's value, which is only applied later)."""
    written = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    written.pop("hydra", None)
    context = OmegaConf.create(_merged(_schema_defaults(written), written))
    return _resolve_written(context, written)


def _schema_defaults(written: Dict[str, Any]) -> Dict[str, Any]:
    """Every group's defaults, and those of the components the config names (unknown names: none)."""
    defaults = {group: {name: _default(f) for name, f in _fields(dc).items()} for group, dc in TRAIN_GROUPS.items()}
    for attr in COMPONENTS + OPTIONAL_COMPONENTS:
        raw = written.get(attr)
        name = raw if isinstance(raw, str) else raw.get("_name") if isinstance(raw, dict) else None
        name = COMPONENT_DEFAULTS.get(attr) if name is None else name
        try:
            dc = _component_dataclass(attr, name) if isinstance(name, str) else None
        except ValueError:
            dc = None  # reported with its fix when the config is checked
        if dc is not None:
            defaults[attr] = {key: _default(f) for key, f in _fields(dc).items()}
    return defaults


def _merged(base: Dict[str, Any], top: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        both = isinstance(out.get(key), dict) and isinstance(value, dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def _resolve_written(node: DictConfig, written: Dict[str, Any]) -> Dict[str, Any]:
    out = {}
    for key, value in written.items():
        if isinstance(value, dict):
            out[key] = _resolve_written(node[key], value)
        elif OmegaConf.is_missing(node, key):
            out[key] = MISSING
        else:
            resolved = node[key]
            is_container = isinstance(resolved, (DictConfig, ListConfig))
            out[key] = OmegaConf.to_container(resolved, resolve=True) if is_container else resolved
    return out


GROUP_PACKAGE_HEADER = re.compile(r"^#\s*@package\s+_group_\s*$", re.MULTILINE)


def _not_yaml(directory: str, names: List[str]) -> List[str]:
    return [n for n in names if not os.path.isdir(os.path.join(directory, n)) and not n.endswith(".yaml")]


@contextlib.contextmanager
def without_group_package_headers(config_dir: str):
    """`config_dir`, or a temporary copy of it without upstream's `# @package _group_` header lines.

    Every upstream fairseq YAML file starts with that header, which under hydra 1.0 meant "this file's own
    package" (the root for the primary config, `model` for model/x.yaml). Hydra >= 1.1 reads `_group_` as a
    plain name and nests every file's content under one `_group_` key, which mixes them up. Without the line,
    hydra 1.3's default package is what the header meant, so the copy composes as upstream's files did."""
    root = Path(config_dir)
    files = list(root.rglob("*.yaml")) if root.is_dir() else []
    if not any(GROUP_PACKAGE_HEADER.search(f.read_text()) for f in files):
        yield config_dir
        return
    with tempfile.TemporaryDirectory(prefix="fairseq-hydra-config-") as tmp:
        # Only what hydra reads: a config directory may also hold data or checkpoints.
        shutil.copytree(root, tmp, dirs_exist_ok=True, ignore=_not_yaml)
        for f in Path(tmp).rglob("*.yaml"):
            f.write_text(GROUP_PACKAGE_HEADER.sub("", f.read_text()))
        yield tmp


def split_recipe(values: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(options, recipe metadata): the `_recipe` mapping taken out of a composed config."""
    values = dict(values)
    recipe = values.pop(RECIPE_KEY, None) or {}
    if not isinstance(recipe, dict):
        raise ValueError(f"{RECIPE_KEY} must be a mapping (recipe metadata), got {recipe!r}")
    return values, recipe


# ---------------------------------------------------------------------------------------- validation


def _fields(dc) -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(dc) if f.init and not f.name.startswith("_")}


def _default(f: dataclasses.Field):
    if "interpolate" in f.metadata:  # configs.II: in a YAML file's context, the owner's value (as upstream)
        return "${" + f.metadata["interpolate"] + "}"
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _unknown_key_error(where: str, key: str, known, owner: str) -> ValueError:
    hint = did_you_mean(key, known, lambda match: f"'{where}.{match}'")
    return ValueError(
        f"unknown key '{where}.{key}'{hint}: {owner} has no option '{key}'; remove it or fix its name "
        "(fairseq-train --help lists the options as flags, with '-' for '_')"
    )


def _coerce(where: str, value, tp, default):
    """Check one value against its field type; returns the value converted where that is lossless."""
    inner, optional = unwrap_optional(tp)
    if value is None:
        if optional or default is None:
            return None
        raise ValueError(f"{where} must not be null (it is a {getattr(inner, '__name__', inner)} option)")
    origin = get_origin(inner)
    if origin is Literal:
        choices = get_args(inner)
        if value not in choices:
            raise ValueError(
                f"{where}={value!r} is not a valid choice{did_you_mean(value, choices)}; choose one of: "
                f"{', '.join(map(str, choices))}"
            )
        return value
    if origin in (list, typing.List):
        (item_type,) = get_args(inner) or (Any,)
        items = value if isinstance(value, (list, tuple)) else [value]  # `lr: 0.001` means [0.001]
        return [_coerce(f"{where}[{i}]", v, item_type, None) for i, v in enumerate(items)]
    if inner is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}={value!r}: expected true or false")
        return value
    if inner is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)  # YAML reads 1e8 as a float
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}={value!r}: expected an integer")
        return value
    if inner is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}={value!r}: expected a number")
        return float(value)
    if inner is str:
        if isinstance(value, (list, tuple)):  # adam_betas: [0.9, 0.95] -> "(0.9, 0.95)", as upstream accepts
            return str(tuple(value))
        if isinstance(value, dict):
            raise ValueError(f"{where}: expected a string, got a mapping")
        return value if isinstance(value, str) else str(value)
    return value


def _check_group(where: str, values, dc, owner: str, skip_missing: bool = False) -> Dict[str, Any]:
    """Validated {field: value} of one group or component (without `_name`)."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"'{where}' must be a mapping of {owner}'s options, got {values!r}")
    fields = _fields(dc)
    hints = typing.get_type_hints(dc)
    checked = {}
    for key, value in values.items():
        if key == "_name":
            continue
        if key not in fields:
            if skip_missing and value == MISSING:
                continue  # `task.data: ???` after switching to a task without data
            raise _unknown_key_error(where, key, fields, owner)
        if value == MISSING:
            raise ValueError(
                f"{where}.{key} is required (it is ??? in the config): add {where}.{key}=VALUE to the command "
                f"line (fairseq-train spells it {flag_name(key) if key != 'data' else 'DATA, the positional argument'})"
            )
        checked[key] = _coerce(f"{where}.{key}", value, hints[key], _default(fields[key]))
    return checked


def _check_legacy_component(where: str, values, cls, owner: str) -> Dict[str, Any]:
    """Validated {option: value} of an upstream legacy component (no dataclass): its keys are the dests of the
    flags its `add_args` declares, checked as those flags would check them."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"'{where}' must be a mapping of {owner}'s options, got {values!r}")
    options = legacy.declared_options(cls)
    checked = {}
    for key, value in values.items():
        if key == "_name" or value == MISSING:
            continue
        if key not in options:
            hint = did_you_mean(key, options, lambda match: f"'{where}.{match}'")
            raise ValueError(
                f"unknown key '{where}.{key}'{hint}: {owner} is a legacy plug-in whose add_args declares "
                f"{', '.join(sorted(options)) or 'no options'}"
            )
        checked[key] = legacy.coerce_option(f"{where}.{key}", options[key], value)
    return checked


def _component_name(attr: str, values) -> Optional[str]:
    if isinstance(values, str):  # `optimizer: adam` is short for `optimizer: {_name: adam}`
        return values
    name = values.get("_name") if isinstance(values, dict) else None
    if name is None:
        name = COMPONENT_DEFAULTS.get(attr)
    if name is None:
        example = "transformer_lm_gpt3_small" if attr == "model" else "adam"
        raise ValueError(f"{attr}._name is missing: the config must choose a {attr}, e.g. {attr}._name={example}")
    if not isinstance(name, str):
        raise ValueError(f"{attr}._name must be a string, got {name!r}")
    return name


def _component_class(attr: str, name: str):
    return registry.arch_model(name) if attr == "model" else COMPONENT_REGISTRIES[attr].get(name)


def _component_dataclass(attr: str, name: str):
    if attr == "model":
        if name not in registry.architectures():
            raise ValueError(
                f"model._name={name!r} is not an architecture"
                f"{did_you_mean(name, registry.architectures())}; choose one of: "
                f"{', '.join(registry.architectures())} (or load a plug-in with common.user_dir)"
            )
        return registry.dataclass_of(registry.arch_model(name))
    reg = COMPONENT_REGISTRIES[attr]
    if name not in reg:
        raise ValueError(
            f"{attr}._name={name!r} is not a registered {reg.kind}{did_you_mean(name, reg.choices())}; "
            "choose one of: "
            f"{', '.join(reg.choices())} (or load a plug-in with common.user_dir)"
        )
    return reg.dataclass(name)


# ---------------------------------------------------------------------------------------- conversion


# Upstream's config.yaml lists these with null defaults; training a language model here uses none of them
# (the generation options are fairseq-generate's flags).
UNUSED_UPSTREAM_GROUPS = ("scoring", "generation", "interactive", "bmuf", "ema")


def _is_unset(value) -> bool:
    # null, {} or {_name: null}; a group holding any other key is set (`generation: {beam: 5}` is not unset)
    return value is None or (isinstance(value, dict) and value.get("_name") is None and set(value) <= {"_name"})


def _without_unused_upstream_groups(values: Dict[str, Any]) -> Dict[str, Any]:
    """Drop upstream groups that are null (or `{_name: null}`); a set one is an error naming the key."""
    out = dict(values)
    for key in UNUSED_UPSTREAM_GROUPS:
        if key not in out:
            continue
        value = out.pop(key)
        if not _is_unset(value):
            raise ValueError(
                f"'{key}' is set to {value!r}, but fairseq-hydra-train here has no {key} "
                f"options (language-model training does not use them): remove '{key}' or set it "
                "to null"
            )
    return out


def fairseq_config_from_dict(values: Dict[str, Any]) -> FairseqConfig:
    """A FairseqConfig from a composed config (plain dict), as `fairseq-train` would build it from flags.

    Raises ValueError naming the key for unknown groups or keys, bad values, a missing required value,
    one option set to two different values in two groups, or --fp16 with --bf16.
    """
    values, _ = split_recipe(values)
    values = _without_unused_upstream_groups(values)
    allowed = list(TRAIN_GROUPS) + list(COMPONENTS) + list(OPTIONAL_COMPONENTS)
    for key in values:
        if key not in allowed:
            hint = did_you_mean(key, allowed)
            raise ValueError(f"unknown top-level key '{key}'{hint}; the config's groups are: {', '.join(allowed)}")
    user_dir = (values.get("common") or {}).get("user_dir")
    if user_dir:  # plug-ins register their components before the component names are looked up
        registry.import_user_module(user_dir)

    explicit: Dict[str, Tuple[Any, str]] = {}  # flag dest -> (value, "group.key" that set it)

    def collect(where: str, checked: Dict[str, Any]):
        for key, value in checked.items():
            if key in explicit and explicit[key][0] != value:
                other, first = explicit[key][0], explicit[key][1]
                raise ValueError(
                    f"{first}={other!r} and {where}.{key}={value!r} set the same option ({flag_name(key)}) to "
                    "different values; fairseq-train has one flag for both, so set it in one place"
                )
            explicit.setdefault(key, (value, f"{where}.{key}"))

    for group, dc in TRAIN_GROUPS.items():
        collect(group, _check_group(group, values.get(group), dc, f"the {group} group ({dc.__name__})"))
    names, dataclasses_ = {}, {}
    for attr in COMPONENTS + OPTIONAL_COMPONENTS:
        raw = values.get(attr)
        if attr in OPTIONAL_COMPONENTS and _is_unset(raw):
            continue
        names[attr] = _component_name(attr, raw)
        dataclasses_[attr] = _component_dataclass(attr, names[attr])
        owner = f"{attr} {names[attr]!r}" + (f" ({dataclasses_[attr].__name__})" if dataclasses_[attr] else "")
        mapping = raw if isinstance(raw, dict) else None
        if dataclasses_[attr] is None:  # upstream's legacy components: flags from add_args, no dataclass
            collect(attr, _check_legacy_component(attr, mapping, _component_class(attr, names[attr]), owner))
        else:
            collect(attr, _check_group(attr, mapping, dataclasses_[attr], owner, skip_missing=True))

    cfg = build_config({key: value for key, (value, _) in explicit.items()}, names)  # names["model"]: the arch
    check_precision(cfg.common)  # the YAML front end's check; parse_args_and_arch makes the flags' one
    return cfg


def resolve_paths(values: Dict[str, Any], base_dir: str) -> Dict[str, Any]:
    """Make the config's relative paths absolute against `base_dir` (the directory the user ran from).

    Covers checkpoint.save_dir, checkpoint.finetune_from_model, checkpoint.restore_file when it names a
    directory (a bare file name is looked up in save_dir), every `:`-separated task.data shard,
    common.log_file, common.tensorboard_logdir, common.user_dir and the bpe group's model files. Returns a new
    dict.
    """
    out = {key: (dict(value) if isinstance(value, dict) else value) for key, value in values.items()}

    def absolute(path):
        if not isinstance(path, str) or path == MISSING or path == "":
            return path
        path = os.path.expanduser(path)
        return path if os.path.isabs(path) else os.path.normpath(os.path.join(base_dir, path))

    for group, keys in (
        ("checkpoint", ("save_dir", "finetune_from_model")),
        ("common", ("log_file", "tensorboard_logdir", "user_dir")),
    ):
        section = out.get(group)
        for key in keys if isinstance(section, dict) else ():
            if section.get(key) is not None:
                section[key] = absolute(section[key])
    checkpoint = out.get("checkpoint")
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("restore_file"), str):
        if os.path.dirname(checkpoint["restore_file"]):
            checkpoint["restore_file"] = absolute(checkpoint["restore_file"])
    for group, keys in (("bpe", ("gpt2_encoder_json", "gpt2_vocab_bpe", "sentencepiece_model")),):
        section = out.get(group)
        for key in keys if isinstance(section, dict) else ():
            if isinstance(section.get(key), str) and "://" not in section[key]:  # not upstream's download URLs
                section[key] = absolute(section[key])
    task = out.get("task")
    if isinstance(task, dict) and isinstance(task.get("data"), str) and task["data"] != MISSING:
        task["data"] = ":".join(absolute(part) for part in task["data"].split(":"))
    return out


# ---------------------------------------------------------------------------------------- recipes


def recipe_update_freq(recipe: Dict[str, Any], batch_size: int, tokens_per_sample: int, world_size: int) -> int:
    """The update_freq that keeps a recipe's global batch (`_recipe.global_batch_tokens`) on `world_size`
    GPUs of `batch_size` sequences of `tokens_per_sample` tokens; ValueError when none does."""
    target = recipe.get("global_batch_tokens")
    if not target:
        raise ValueError(f"the recipe has no {RECIPE_KEY}.global_batch_tokens")
    per_step = batch_size * tokens_per_sample * world_size
    if per_step <= 0 or target % per_step != 0:
        sequences = target // tokens_per_sample
        raise ValueError(
            f"no update_freq gives the recipe's global batch of {target:,} tokens ({sequences} sequences) with "
            f"dataset.batch_size {batch_size} on {world_size} GPU(s): pick a GPU count and batch size whose "
            f"product divides {sequences}, or set dataset.batch_size and optimization.update_freq yourself"
        )
    return target // per_step
