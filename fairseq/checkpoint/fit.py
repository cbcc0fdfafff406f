"""Whether a checkpoint fits the model built from the command line: the same parameter names and shapes (a
readable error naming the first difference, and a dictionary of another size named as such), and, when resuming,
the same options that change what the network computes."""

from typing import Any, Dict, Mapping, Optional, Tuple

from fairseq.checkpoint.io import CheckpointError
from fairseq import registry
from fairseq.dataclass.build import model_config


def model_state_for_checking(model) -> Dict[str, Any]:
    """The model's state under checkpoint names (no DDP/FSDP prefixes), without gathering shards."""
    # torch.distributed.checkpoint: ~1.5 s
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # deferred: startup

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))


def architecture_options(arch: Optional[str]) -> Tuple[str, ...]:
    """The options that define the function the model of `arch` computes (its class's `architecture_options`);
    () for an unknown or missing arch."""
    try:
        return tuple(getattr(registry.arch_model(arch), "architecture_options", ())) if arch else ()
    except ValueError:  # an arch of a plug-in not loaded here: nothing to compare by
        return ()


def differing_option(options, saved: Mapping[str, Any], here: Mapping[str, Any]) -> Optional[str]:
    """The first of `options` that both model configs (plain dicts) hold with different values, else None."""
    for name in options:
        if name in saved and name in here and saved[name] != here[name]:
            return name
    return None


def option_flag(name: str) -> str:
    flag = "--" + name.replace("_", "-")
    return flag + " (--tokens-per-sample when unset)" if name == "max_target_positions" else flag


def check_same_model_options(path: str, state: Dict[str, Any], cfg) -> None:
    """Resuming with model options that change what the network computes (some change no parameter shape:
    heads, normalization order, activation) would continue another model from these weights: refuse, naming
    the option. The model class lists those options (`architecture_options`)."""
    saved = (state.get("cfg") or {}).get("model") or {}
    if not isinstance(saved, dict) or cfg.model is None:
        return
    options = architecture_options(cfg.model._name)
    name = differing_option(options, saved, {n: getattr(cfg.model, n) for n in options if hasattr(cfg.model, n)})
    if name is not None:
        raise CheckpointError(
            f"{path} was saved from a different architecture: {option_flag(name)} is {getattr(cfg.model, name)!r} "
            f"here but {saved[name]!r} in the checkpoint, so resuming would train another model from these "
            f"weights. {_how_to_resume(name, saved, cfg.model)}, or start a new --save-dir (with "
            "--finetune-from-model to begin from these weights)"
        )


def _how_to_resume(name: str, saved: Mapping[str, Any], here) -> str:
    """A fix the parser accepts: the checkpoint's --arch when it is another; a boolean (store_true) flag given or
    left out; else the flag with the checkpoint's value."""
    flag, value, arch = "--" + name.replace("_", "-"), saved[name], saved.get("_name")
    if arch and arch != here._name:
        return f"Resume with --arch {arch} (the checkpoint's; this run has --arch {here._name})"
    if isinstance(value, bool) or value is None:
        if value:
            return f"Resume with {flag}"
        if getattr(model_config(here._name, {}), name) == value:  # the preset leaves it unset without the flag
            return f"Resume without {flag}"
        return (
            f"Resume with fairseq-hydra-train and model.{name}={'null' if value is None else 'false'} (the "
            f"--arch {here._name} preset sets {flag}, and no flag unsets it)"
        )
    shown = value if isinstance(value, (int, float, str)) else repr(value)
    return f"Resume with {flag} {shown}"


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
