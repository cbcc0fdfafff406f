"""Whether a checkpoint fits the model built from the command line: the same parameter names and shapes (a
readable error naming the first difference, and a dictionary of another size named as such), and, when resuming,
the same options that change what the network computes."""

from typing import Any, Dict

from fairseq.checkpoint.io import CheckpointError


def model_state_for_checking(model) -> Dict[str, Any]:
    """The model's state under checkpoint names (no DDP/FSDP prefixes), without gathering shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))


def check_same_model_options(path: str, state: Dict[str, Any], cfg) -> None:
    """Resuming with model options that change what the network computes (some change no parameter shape:
    heads, normalization order, activation) would continue another model from these weights: refuse, naming
    the option. The model class lists those options (`architecture_options`)."""
    from fairseq import registry

    saved = (state.get("cfg") or {}).get("model") or {}
    if not isinstance(saved, dict) or cfg.model is None:
        return
    options = getattr(registry.arch_model(cfg.model._name), "architecture_options", ())
    for name in options:
        if name in saved and hasattr(cfg.model, name) and saved[name] != getattr(cfg.model, name):
            flag = "--" + name.replace("_", "-")
            if name == "max_target_positions":
                flag += " (--tokens-per-sample when unset)"
            raise CheckpointError(
                f"{path} was saved from a different architecture: {flag} is {getattr(cfg.model, name)!r} here but "
                f"{saved[name]!r} in the checkpoint, so resuming would train another model from these weights. "
                f"Resume with {flag} {saved[name]!r}, or start a new --save-dir (with --finetune-from-model to "
                "begin from these weights)"
            )


def check_architecture(path: str, state: Dict[str, Any], expected: Dict[str, Any]) -> None:
    """Fail with a readable message when the checkpoint's parameters do not fit the model's state `expected`
    (global shapes: a sharded parameter counts with its full shape)."""
    expected_shapes = {k: tuple(v.shape) for k, v in expected.items()}
    found_shapes = {k: tuple(v.shape) for k, v in state["model"].items() if hasattr(v, "shape")}
    missing = sorted(set(expected_shapes) - set(found_shapes))
    unexpected = sorted(set(found_shapes) - set(expected_shapes))
    mismatched = [k for k in expected_shapes if k in found_shapes and expected_shapes[k] != found_shapes[k]]
    vocab_keys = [k for k in mismatched if k.endswith(("embed_tokens.weight", "output_projection.weight"))]
    if vocab_keys and len(vocab_keys) == len(mismatched) and not (missing or unexpected):
        k = vocab_keys[0]
        if found_shapes[k][1:] == expected_shapes[k][1:]:
            raise CheckpointError(
                f"dictionary does not match the checkpoint: {path} was trained with a vocabulary of "
                f"{found_shapes[k][0]} entries but the dictionary here (dict.txt of the data directory) has "
                f"{expected_shapes[k][0]}; use the data directory (dict.txt) the checkpoint was trained with"
            )
    if missing or unexpected or mismatched:
        saved_arch = (state.get("cfg") or {}).get("model", {}) or {}
        saved_arch = saved_arch.get("_name", "unknown") if isinstance(saved_arch, dict) else "unknown"
        details = []
        if mismatched:
            k = mismatched[0]
            details.append(f"{k} is {found_shapes[k]} in the checkpoint but {expected_shapes[k]} in the model")
        if missing:
            details.append(f"missing {len(missing)} parameter(s), e.g. {missing[0]}")
        if unexpected:
            details.append(f"{len(unexpected)} unexpected parameter(s), e.g. {unexpected[0]}")
        raise CheckpointError(
            f"{path} was saved from a different architecture ({saved_arch}) than the model built from the "
            f"command line: {'; '.join(details)}. Use the same --arch and model flags as the checkpoint, or "
            "start elsewhere with a different --save-dir."
        )
