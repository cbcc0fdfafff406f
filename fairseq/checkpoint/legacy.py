"""Upstream fairseq checkpoints (loaded only with --trust-legacy-checkpoint) into this project's layout.

Upstream stores its configuration as an omegaconf DictConfig (`cfg`) or an argparse Namespace (`args`,
older files), and model weights under upstream's names. Its optimizer state is indexed by flattened
parameter groups and cannot be mapped reliably, so it is dropped: such a file serves evaluation and
--finetune-from-model, and resuming from it needs --reset-optimizer.
"""

import argparse
from typing import Any, Dict

import torch

from fairseq import registry


def _plain(value):
    try:
        # ~0.3 s, for checkpoints holding its configs only
        from omegaconf import DictConfig, ListConfig, OmegaConf  # deferred: startup

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=False)
    except ImportError:
        pass
    if hasattr(value, "__dict__") and not isinstance(value, dict):
        return dict(vars(value))
    return value


def is_legacy_checkpoint(state: Dict[str, Any]) -> bool:
    cfg = state.get("cfg")
    if "args" in state and state["args"] is not None or (cfg is not None and not isinstance(cfg, dict)):
        return True
    # fairseq 0.10-0.12 saves a plain dict whose groups for components without a dataclass (fconv_lm's model,
    # say) are argparse Namespaces; this fork's files never hold one.
    return isinstance(cfg, dict) and any(isinstance(v, argparse.Namespace) for v in cfg.values())


def upgrade_legacy_checkpoint(state: Dict[str, Any]) -> Dict[str, Any]:
    if state.get("cfg") is not None:
        cfg = _plain(state["cfg"])
        cfg = {k: _plain(v) for k, v in cfg.items()}
        model_cfg = dict(cfg.get("model") or {})
        if "_name" not in model_cfg and "arch" in model_cfg:
            model_cfg["_name"] = model_cfg["arch"]
        model_cfg["_name"] = model_cfg.get("arch", model_cfg.get("_name"))
        task_cfg = dict(cfg.get("task") or {})
    else:  # fairseq < 0.10: one flat argparse Namespace
        args = _plain(state["args"])
        model_cfg = dict(args, _name=args.get("arch"))
        task_cfg = dict(args, _name=args.get("task"))
    upgraded = {
        "cfg": {"model": model_cfg, "task": task_cfg},
        "model": upgrade_state_dict(registry.arch_model(model_cfg["_name"]), state["model"], model_cfg),
        "last_optimizer_state": None,
        "extra_state": {},
        "legacy": True,
    }
    return upgraded


def upgrade_state_dict(model_cls: type, state_dict: dict, cfg=None) -> dict:
    """An upstream state dict of `model_cls` under today's names: this module's upgrade of the model's class (or
    of the first base class that has one), else the model's own `upgrade_state_dict` hook (plug-ins)."""
    for klass in model_cls.__mro__:
        upgrade = UPSTREAM_STATE_DICTS.get(f"{klass.__module__}.{klass.__qualname__}")
        if upgrade is not None:
            return upgrade(state_dict, cfg)
    return model_cls.upgrade_state_dict(state_dict, cfg)


def upgrade_transformer_lm(state_dict: dict, cfg=None) -> dict:
    """Map an upstream transformer_lm state dict (any vintage) to this model's keys; returns a new dict.

    - `decoder.embed_out` (older output matrix) -> `decoder.output_projection.weight`; with shared
      embeddings and no output key, the embedding matrix is used, as upstream does;
    - fused `self_attn.in_proj_weight/bias` -> `q_proj`, `k_proj`, `v_proj` (upstream's row order);
    - `layers.N.layer_norms.{0,1,2}` -> `self_attn_layer_norm`, `encoder_attn_layer_norm`,
      `final_layer_norm`;
    - a saved sinusoidal table `embed_positions.weights` -> the `_float_tensor` placeholder;
    - adaptive input / softmax weights keep their (upstream) names; an adaptive softmax without
      `decoder.adaptive_softmax.version` predates upstream's current tail layout and is refused, as upstream
      refuses it; the value-less `_float_tensor` buffers are added when a file lacks them;
    - `decoder.version` <= 2 (or missing, with no `decoder.layer_norm.*`) marks a checkpoint from before
      the final layer norm existed: as upstream, the version becomes 1 and `cfg` (a dict or config
      object, when given) gets `no_decoder_final_norm = True` so the model is built to match; a missing
      version next to a final layer norm is restored as 3.
    """
    out = dict(state_dict)
    adaptive_softmax = any(k.startswith("decoder.adaptive_softmax.") for k in out)
    if "decoder.embed_out" in out:
        out["decoder.output_projection.weight"] = out.pop("decoder.embed_out")
    elif (
        "decoder.output_projection.weight" not in out and "decoder.embed_tokens.weight" in out and not adaptive_softmax
    ):
        out["decoder.output_projection.weight"] = out["decoder.embed_tokens.weight"]
    if adaptive_softmax:
        if "decoder.adaptive_softmax.version" not in out:
            raise ValueError(
                "decoder.adaptive_softmax has no version: an adaptive softmax from before upstream's "
                "version 1 (a different tail layout), which upstream fairseq no longer loads either"
            )
        if "decoder.adaptive_softmax.head.class_proj.weight" in out:
            out.setdefault("decoder.adaptive_softmax.head._float_tensor", torch.zeros(1))
    if "decoder.embed_tokens.embeddings.0.0.weight" in out:
        out.setdefault("decoder.embed_tokens._float_tensor", torch.zeros(1))
    _split_fused_projections(out)
    old_norm_names = {"0": "self_attn_layer_norm", "1": "encoder_attn_layer_norm", "2": "final_layer_norm"}
    for key in [k for k in out if ".layer_norms." in k]:
        head, tail = key.split(".layer_norms.", 1)
        index, param = tail.split(".", 1)
        if index in old_norm_names:
            out[f"{head}.{old_norm_names[index]}.{param}"] = out.pop(key)
    if "decoder.embed_positions.weights" in out:
        del out["decoder.embed_positions.weights"]
        out["decoder.embed_positions._float_tensor"] = torch.zeros(1)
    _final_norm_version(out, cfg)
    return out


def _split_fused_projections(out: dict) -> None:
    """Fused `in_proj_weight/bias` -> `q_proj`, `k_proj`, `v_proj` (upstream's row order), in place."""
    for key in [k for k in out if k.endswith((".in_proj_weight", ".in_proj_bias"))]:
        prefix, kind = key.rsplit(".in_proj_", 1)
        fused = out.pop(key)
        if fused.size(0) % 3 != 0:
            raise ValueError(f"{key}: fused projection of {fused.size(0)} rows cannot be split into q, k, v")
        for name, part in zip(("q_proj", "k_proj", "v_proj"), fused.chunk(3, dim=0)):
            out[f"{prefix}.{name}.{kind}"] = part.clone()


def _final_norm_version(out: dict, cfg) -> None:
    """`decoder.version` as upstream reads it (whether the final layer norm exists), `cfg` made to match."""
    version = out.get("decoder.version")
    has_final_norm = any(k.startswith("decoder.layer_norm.") for k in out)
    if version is None and has_final_norm:
        out["decoder.version"] = torch.tensor([3.0])  # only the buffer was dropped by whoever saved it
    elif version is None or float(version.flatten()[0]) <= 2:
        if has_final_norm:
            raise ValueError(
                "decoder.version <= 2 says this checkpoint has no final layer norm, yet it holds "
                "decoder.layer_norm.*; the file is inconsistent (upstream refuses it too)"
            )
        out["decoder.version"] = torch.tensor([1.0])
        if cfg is not None:
            if isinstance(cfg, dict):
                cfg["no_decoder_final_norm"] = True
            else:
                cfg.no_decoder_final_norm = True


# Upstream's names -> ours, per built-in model class (its module and name: nothing here imports the models).
# Plug-ins and models without an entry upgrade through their `upgrade_state_dict` classmethod (the model
# contract's hook; fconv_lm's is its own).
UPSTREAM_STATE_DICTS = {"fairseq.models.transformer_lm.TransformerLanguageModel": upgrade_transformer_lm}
