"""Upstream fairseq checkpoints (loaded only with --trust-legacy-checkpoint) into this project's layout.

Upstream stores its configuration as an omegaconf DictConfig (`cfg`) or an argparse Namespace (`args`,
older files), and model weights under upstream's names. Its optimizer state is indexed by flattened
parameter groups and cannot be mapped reliably, so it is dropped: such a file serves evaluation and
--finetune-from-model, and resuming from it needs --reset-optimizer.
"""

import argparse
from typing import Any, Dict


def _plain(value):
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

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
    from fairseq import registry

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
        "model": registry.arch_model(model_cfg["_name"]).upgrade_state_dict(state["model"], model_cfg),
        "last_optimizer_state": None,
        "extra_state": {},
        "legacy": True,
    }
    return upgraded
