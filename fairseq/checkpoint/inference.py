"""Load a trained model (single file, sharded directory, or trusted upstream file) for evaluation and generation.

The one loading path of fairseq-eval-lm, fairseq-generate, fairseq-interactive, `fairseq.checkpoint_utils` and
`from_pretrained`: read the saved config and state without unpickling code (unless trusted), apply upstream-style
overrides to the saved config, set up the task, build the model from the saved model config, fill its weights.
"""

import collections
import copy
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from fairseq import registry
from fairseq.checkpoint import sharded
from fairseq.checkpoint.io import CheckpointError, load_checkpoint_file
from fairseq.checkpoint.legacy import is_legacy_checkpoint, upgrade_legacy_checkpoint
from fairseq.checkpoint.fit import check_architecture
from fairseq.checkpoint.vocabulary import carried, check_dictionary
from fairseq.dataclass.utils import config_from_dict
from fairseq.dataclass.configs import FairseqConfig
from fairseq.dataclass.generation import GenerationConfig, InteractiveConfig
from fairseq.data.encoders import BPE_REGISTRY, TOKENIZER_REGISTRY

# Config groups chosen by name (`_name`), in FairseqConfig's order.
COMPONENT_GROUPS = ("task", "model", "criterion", "optimizer", "lr_scheduler", "bpe", "tokenizer")


@dataclass
class ShardedCheckpoint:
    """Stands for a sharded directory's state until its shards are read into a model (load_model_weights)."""

    path: str  # the resolved directory
    trust_legacy: bool = False  # --trust-legacy-checkpoint: read it with plain pickle
    vocabulary: Optional[Dict[str, Any]] = None  # metadata.pt's record (fairseq.checkpoint.vocabulary)


def transformers_model_type(directory: str) -> Optional[str]:
    """The model_type of a transformers model directory (its config.json names one); None for anything else."""
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return str(model_type) if model_type is not None else None


def refuse_transformers_directory(path: str) -> None:
    """A transformers model directory, or one of its files, given where a fairseq checkpoint belongs: one line
    saying how to load it (scripts/import_hf.py, or from_pretrained, which imports it)."""
    if os.path.isdir(path):
        directory = path
        if sharded.resolve_sharded(path) is not None:
            return
    else:
        directory = os.path.dirname(path) or "."
        name = os.path.basename(path)
        if not (name.endswith((".safetensors", ".json")) or (name.startswith("pytorch_model") and ".bin" in name)):
            return
    model_type = transformers_model_type(directory)
    if model_type is not None:
        raise CheckpointError(
            f"{path} is {'' if directory == path else 'a file of '}a transformers model directory (config.json of "
            f"model_type {model_type}), not a fairseq checkpoint: import it with `python scripts/import_hf.py "
            f"{directory} OUT_DIR` and pass --path OUT_DIR/checkpoint_best.pt, or load it in Python with "
            f"TransformerLanguageModel.from_pretrained({directory!r})"
        )


def read_checkpoint_config(
    path: str, trust_legacy: bool = False
) -> Tuple[Dict[str, Any], Union[Dict, ShardedCheckpoint]]:
    """(saved cfg as a plain dict, full state of a file or a ShardedCheckpoint for a sharded directory)."""
    refuse_transformers_directory(path)
    if os.path.isdir(path):
        resolved = _resolve_directory(path)
        metadata = sharded.read_metadata(resolved, trust_legacy=trust_legacy)
        return metadata["cfg"], ShardedCheckpoint(resolved, trust_legacy, carried(metadata))
    state = _upgraded(load_checkpoint_file(path, trust_legacy=trust_legacy))
    return state["cfg"], state


def read_checkpoint_state(path: str, trust_legacy: bool = False) -> Dict[str, Any]:
    """The whole state of a checkpoint file or sharded directory on the CPU, in upstream's layout ("cfg",
    "model", ...). A directory's model tensors are allocated from DCP's index, at their full shapes."""
    refuse_transformers_directory(path)
    if not os.path.isdir(path):
        return _upgraded(load_checkpoint_file(path, trust_legacy=trust_legacy))
    # Imported here, for sharded directories only: torch.distributed.checkpoint costs ~1.5 s to import.
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # deferred: startup

    from fairseq.checkpoint import safe_dcp  # deferred: startup (safe_dcp imports torch.distributed.checkpoint)

    resolved = _resolve_directory(path)
    index = safe_dcp.read_dcp_metadata(resolved, trust_legacy=trust_legacy).state_dict_metadata
    model_state = {
        key[len("model.") :]: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in index.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    return sharded.load_sharded(resolved, model_state, trust_legacy=trust_legacy)


def _resolve_directory(path: str) -> str:
    resolved = sharded.resolve_sharded(path)
    if resolved is None:
        raise FileNotFoundError(f"{path} is not a complete sharded checkpoint (no {sharded.METADATA})")
    return resolved


def _upgraded(state: Dict[str, Any]) -> Dict[str, Any]:
    return upgrade_legacy_checkpoint(state) if is_legacy_checkpoint(state) else state


# ---------------------------------------------------------------------------------------- saved configs


def _group_types() -> Dict[str, type]:
    """Groups of a full config that are not chosen by name: FairseqConfig's, then generation and interactive."""
    types = {
        f.name: f.default_factory
        for f in dataclasses.fields(FairseqConfig)
        if f.default_factory is not dataclasses.MISSING
    }
    types.update(generation=GenerationConfig, interactive=InteractiveConfig)
    return types


def component_dataclass(attr: str, name: Optional[str]) -> Optional[type]:
    """The config dataclass of component `attr` registered as `name` (None: not registered or none)."""
    if not is_registered(attr, name):
        return None
    if attr == "model":
        return registry.dataclass_of(registry.arch_model(name))
    return _component_registry(attr).dataclass(name)


def is_registered(attr: str, name: Optional[str]) -> bool:
    """Whether component `attr` named `name` is registered here (a legacy one has no dataclass)."""
    if name is None:
        return False
    return name in (registry.architectures() if attr == "model" else _component_registry(attr))


def _component_registry(attr: str):
    if attr in ("bpe", "tokenizer"):
        return BPE_REGISTRY if attr == "bpe" else TOKENIZER_REGISTRY
    return {
        "task": registry.TASK_REGISTRY,
        "criterion": registry.CRITERION_REGISTRY,
        "optimizer": registry.OPTIMIZER_REGISTRY,
        "lr_scheduler": registry.LR_SCHEDULER_REGISTRY,
    }[attr]


def _option_names(attr: str, group: Dict[str, Any]) -> set:
    dc = component_dataclass(attr, group.get("_name")) if attr in COMPONENT_GROUPS else _group_types().get(attr)
    names = {f.name for f in dataclasses.fields(dc)} if dc is not None else set()
    return {n for n in names | set(group) if not n.startswith("_")}


def apply_overrides(saved_cfg: Dict[str, Any], overrides: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """A copy of a saved config (a plain dict of groups) with upstream's `arg_overrides` applied.

    A key sets that option in every group that has it (`{"data": DIR}` is task.data, `{"decoder_layers": 3}`
    the model's). A component's name (`{"bpe": "gpt2"}`; None or "none" removes it) selects that component
    with its defaults, whose options the other keys then set (`gpt2_encoder_json`). A key that is no option
    of any group raises ValueError (upstream ignores it silently)."""
    out = {key: (dict(value) if isinstance(value, dict) else value) for key, value in saved_cfg.items()}
    for name in _group_types():
        out.setdefault(name, {})
    overrides = dict(overrides or {})
    used = set()
    for attr in COMPONENT_GROUPS:
        if attr not in overrides:
            continue
        value, current = overrides[attr], out.get(attr)
        current_name = current.get("_name") if isinstance(current, dict) else None
        if isinstance(value, dict):
            out[attr] = dict(current or {}, **value)
        elif value is None or value == "none":
            out[attr] = None
        elif value != current_name:
            out[attr] = {"_name": value}
        used.add(attr)
    for attr, group in out.items():
        if not isinstance(group, dict):
            continue
        names = _option_names(attr, group)
        for key, value in overrides.items():
            if key in names and key not in COMPONENT_GROUPS:
                group[key] = value
                used.add(key)
    unknown = sorted(set(overrides) - used)
    if unknown:
        raise ValueError(
            f"override {unknown[0]!r} is no option of the checkpoint's configuration (nor of its "
            "--bpe/--tokenizer); check the name, e.g. {'data': 'data-bin'} or {'bpe': 'gpt2'}"
        )
    return out


def config_from_saved(saved_cfg: Dict[str, Any]):
    """The FairseqConfig (plus `generation` and `interactive` groups) of a saved config dict. Components whose
    names are not registered here (a plug-in not imported) stay plain dicts, except the model (an error);
    registered legacy ones (no dataclass) are argparse namespaces, as they were built."""
    cfg = FairseqConfig()
    for name, dc in _group_types().items():
        values = saved_cfg.get(name)
        setattr(cfg, name, config_from_dict(dc, values if isinstance(values, dict) else {}))
    for attr in COMPONENT_GROUPS:
        values = saved_cfg.get(attr)
        if not isinstance(values, dict) or values.get("_name") is None:
            setattr(cfg, attr, None)
            continue
        dc = component_dataclass(attr, values["_name"])
        registered = dc is not None or is_registered(attr, values["_name"])
        setattr(cfg, attr, config_from_dict(dc, values) if registered else dict(values))
    return cfg


# ---------------------------------------------------------------------------------------- models


def load_model_weights(
    model: torch.nn.Module, path: str, state: Union[Dict, ShardedCheckpoint, None], strict: bool = True
) -> None:
    """Fill `model` from a single-file state or from the shards of directory `path` (any world size; None
    stands for ShardedCheckpoint(path), read without trusting pickles). With `strict`, a checkpoint of another
    architecture is a CheckpointError naming the first difference."""
    if state is None or isinstance(state, ShardedCheckpoint):
        shards = state or ShardedCheckpoint(sharded.resolve_sharded(path))
        model_state = model.state_dict()
        sharded.load_sharded(shards.path, model_state, trust_legacy=shards.trust_legacy)
        model.load_state_dict(model_state)
    else:
        if strict:
            check_architecture(path, state, model.state_dict())
        model.load_state_dict(state["model"], strict=strict)


class LoadedModel(NamedTuple):
    model: torch.nn.Module  # on the CPU, in fp32, in training mode (as built)
    cfg: Any  # config_from_saved of `saved_cfg`
    saved_cfg: Dict[str, Any]  # the checkpoint's config dict, overrides applied
    task: Any
    vocabulary: Optional[Dict[str, Any]] = None  # what it carries about its text (resolve_bpe's `record`)


def load_model(
    path: str,
    task=None,
    task_cfg=None,
    overrides: Optional[Dict[str, Any]] = None,
    trust_legacy: bool = False,
    strict: bool = True,
    state: Optional[Dict[str, Any]] = None,
) -> LoadedModel:
    """Load the model saved at `path` (a .pt file or a sharded checkpoint directory).

    The task is `task` if given, else set up from `task_cfg` (a command line's task config), else from the
    checkpoint's task config (after `overrides`). A model trained with --add-bos-token expects <s> first, so the
    task is set up from a copy of a command-line task config with add_bos_token from the checkpoint (read it
    from `task.cfg`). `state` is the checkpoint's already read
    state (read_checkpoint_state), so the file is not read twice."""
    if state is None:
        saved, state = read_checkpoint_config(path, trust_legacy=trust_legacy)
    else:
        state = _upgraded(state)
        saved = state["cfg"]
    saved = apply_overrides(saved or {}, overrides)
    arch = (saved.get("model") or {}).get("_name")
    if arch not in registry.architectures():
        raise CheckpointError(
            f"{path} holds a model of architecture {arch!r}, which is not registered here "
            f"(architectures: {', '.join(registry.architectures())}); load its plug-in with "
            "--user-dir, or pass a checkpoint of a language model trained with this fairseq"
        )
    cfg = config_from_saved(saved)
    if task is None:
        if task_cfg is None:
            task_cfg = cfg.task
        elif (saved.get("task") or {}).get("add_bos_token") and hasattr(task_cfg, "add_bos_token"):
            task_cfg = copy.copy(task_cfg)  # the caller's config stays as given
            task_cfg.add_bos_token = True
        task = registry.TASK_REGISTRY.get(task_cfg._name).setup_task(task_cfg)
    model = task.build_model(cfg.model)
    load_model_weights(model, path, state, strict=strict)
    check_dictionary(path, carried(state), getattr(task, "source_dictionary", None))
    if isinstance(state, dict) and state.get("task_state"):
        task.load_state_dict(state["task_state"])
    return LoadedModel(model, cfg, saved, task, carried(state))


# ----------------------------------------------------------------------------- upstream's loading signatures
# (fairseq.checkpoint_utils re-exports them; fairseq-validate and the hub call them here)


def load_checkpoint_to_cpu(
    path: str,
    arg_overrides: Optional[Dict[str, Any]] = None,
    load_on_all_ranks: bool = False,
    trust_legacy_checkpoint: bool = False,
) -> Dict[str, Any]:
    """The checkpoint's state in upstream's layout: "cfg" (a plain dict of config groups, `arg_overrides`
    applied), "model" (the full state dict, also of a sharded directory), and the training state that was
    saved with it. `load_on_all_ranks` is accepted for upstream compatibility: every caller reads the file."""
    state = read_checkpoint_state(path, trust_legacy=trust_legacy_checkpoint)
    state["cfg"] = apply_overrides(state.get("cfg") or {}, arg_overrides)
    return state


def _checkpoint_path(filename: str, suffix: str) -> str:
    # upstream's --checkpoint-suffix: checkpoint_best.pt -> checkpoint_best{suffix}.pt
    return filename[: -len(".pt")] + suffix + ".pt" if suffix and filename.endswith(".pt") else filename + suffix


def load_model_ensemble_and_task(
    filenames: List[str],
    arg_overrides: Optional[Dict[str, Any]] = None,
    task=None,
    strict: bool = True,
    suffix: str = "",
    num_shards: int = 1,
    state: Optional[Dict[str, Any]] = None,
    trust_legacy_checkpoint: bool = False,
) -> Tuple[list, Any, Any]:
    """(models, cfg, task) for the checkpoints `filenames` (an ensemble of one model per file).

    `cfg` is the first checkpoint's config (a FairseqConfig with `generation` and `interactive` groups) after
    `arg_overrides` ({"data": "data-bin"}: the dictionary's directory when the data moved since training);
    `task` is the given one or set up from that config. With `strict=False` parameters that do not match the
    model are skipped instead of an error. `state`: the single checkpoint's already loaded state.
    `num_shards` > 1 (upstream's one-file-per-rank checkpoints) does not exist here: a sharded checkpoint is a
    directory, passed as the path."""
    if num_shards != 1:
        raise ValueError(
            f"num_shards={num_shards}: checkpoints split into one file per rank are upstream's "
            "format; a sharded checkpoint here is one directory (--use-sharded-state): pass its path"
        )
    if isinstance(filenames, str):
        filenames = [filenames]
    if state is not None and len(filenames) != 1:
        raise ValueError("state= is the state of one checkpoint; pass exactly one filename with it")
    models, cfg = [], None
    for filename in filenames:
        path = _checkpoint_path(filename, suffix)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Model file not found: {path}")
        loaded = load_model(
            path, task=task, overrides=arg_overrides, trust_legacy=trust_legacy_checkpoint, strict=strict, state=state
        )
        loaded.model.eval()
        models.append(loaded.model)
        task = loaded.task  # every member of an ensemble shares the first one's task (its dictionary)
        cfg = cfg if cfg is not None else loaded.cfg
    return models, cfg, task


def load_model_ensemble(
    filenames: List[str],
    arg_overrides: Optional[Dict[str, Any]] = None,
    task=None,
    strict: bool = True,
    suffix: str = "",
    num_shards: int = 1,
    state: Optional[Dict[str, Any]] = None,
    trust_legacy_checkpoint: bool = False,
) -> Tuple[list, Any]:
    """(models, cfg): load_model_ensemble_and_task without the task."""
    models, cfg, _ = load_model_ensemble_and_task(
        filenames, arg_overrides, task, strict, suffix, num_shards, state, trust_legacy_checkpoint
    )
    return models, cfg


def load_ema_from_checkpoint(fpath: str, trust_legacy_checkpoint: bool = False) -> Dict[str, Any]:
    """The checkpoint's state with "model" replaced by its EMA weights (extra_state["ema"], written with
    --store-ema; fp16 weights in fp32), as upstream: e.g. to save them as a model of their own. A sharded
    directory's EMA shards are read whole."""
    if os.path.isdir(fpath):
        # torch.distributed.checkpoint: ~1.5 s
        from fairseq.checkpoint.consolidate import read_full_state  # deferred: startup

        path = sharded.resolve_sharded(fpath)
        if path is None:
            raise FileNotFoundError(f"{fpath} is not a complete sharded checkpoint (no {sharded.METADATA})")
        state = sharded.read_metadata(path, trust_legacy=trust_legacy_checkpoint)
        ema = read_full_state(path, keys=["ema"], trust_legacy=trust_legacy_checkpoint).get("ema")
    else:
        state = load_checkpoint_file(fpath, trust_legacy=trust_legacy_checkpoint)
        ema = (state.get("extra_state") or {}).get("ema")
    return with_ema_as_model(state, ema, fpath)


def with_ema_as_model(state: Dict[str, Any], ema: Optional[Dict[str, Any]], fpath: str) -> Dict[str, Any]:
    """`state` with "model" replaced by the EMA weights `ema` (fp16 ones in fp32, copies)."""
    if not ema:
        raise ValueError(f"{fpath} holds no EMA weights (extra_state['ema']); was the model trained with --store-ema?")
    state["model"] = collections.OrderedDict(
        (key, (value.float() if value.dtype == torch.float16 else value).clone()) for key, value in ema.items()
    )
    return state
