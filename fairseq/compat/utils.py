"""Upstream's `fairseq.utils` (the module `fairseq.utils` is this one): the helpers plug-ins and scripts call
(make_positions, strip_pad, move_to_cuda, set_torch_seed, clip_grad_norm_, ...), each a thin layer over where
this fork implements it. The core's own helpers live with their owners and are re-exported here under
upstream's names: import_user_module (fairseq.registry), run_console_script (fairseq_cli.console),
literal_or_none / fill_missing (fairseq.dataclass.flag_values), resolve_max_positions (fairseq.data.batching)."""

import ast
import os
import warnings
from typing import Any, Callable, List, Optional

import torch
import torch.nn.functional as F

from fairseq.data.batching import resolve_max_positions  # noqa: F401
from fairseq.dataclass.flag_values import fill_missing, literal_or_none  # noqa: F401 (upstream's names)
from fairseq.distributed import parallelize
from fairseq.logging import metrics
from fairseq.modules import activations, positional_embedding
from fairseq.registry import import_user_module  # noqa: F401
from fairseq.upstream_absent import absent_name
from fairseq_cli.console import run_console_script  # noqa: F401


# Upstream's `fairseq.utils` helpers that plug-in criterions call in their reduce_metrics.
def get_perplexity(loss, round: int = 2, base: float = 2):
    return metrics.get_perplexity(loss, round=round, base=base)


def item(value):
    """A Python number from a 0-dim tensor (a plain number passes through; a sequence gives its first)."""
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "__getitem__"):
        return value[0]
    return value


# ------------------------------------------------------------------------------------------ tensors


def make_positions(tensor: torch.Tensor, padding_idx: int, onnx_trace: bool = False) -> torch.Tensor:
    """Position ids: padding_idx + 1, + 2, ... over non-pad tokens, padding_idx at pads (upstream's rule)."""
    return positional_embedding.make_positions(tensor, padding_idx)


def strip_pad(tensor: torch.Tensor, pad: int) -> torch.Tensor:
    """The elements of `tensor` that are not `pad` (1-D)."""
    return tensor[tensor.ne(pad)]


def buffered_arange(max: int) -> torch.Tensor:
    return torch.arange(max)


def convert_padding_direction(
    src_tokens: torch.Tensor, padding_idx: int, right_to_left: bool = False, left_to_right: bool = False
) -> torch.Tensor:
    """Move each row's padding from the left to the right (`left_to_right`) or the other way."""
    if right_to_left == left_to_right:
        raise ValueError("convert_padding_direction: pass exactly one of right_to_left, left_to_right")
    pad_mask = src_tokens.eq(padding_idx)
    if not pad_mask.any():
        return src_tokens
    if left_to_right and not pad_mask[:, 0].any():
        return src_tokens  # already right-padded
    if right_to_left and not pad_mask[:, -1].any():
        return src_tokens  # already left-padded
    max_len = src_tokens.size(1)
    num_pads = pad_mask.long().sum(dim=1, keepdim=True)
    positions = torch.arange(max_len, device=src_tokens.device).expand_as(src_tokens)
    # a row rotates by its number of pads: left pads move to the end, or right pads to the front
    index = (
        torch.remainder(positions + num_pads, max_len)
        if left_to_right
        else torch.remainder(positions - num_pads, max_len)
    )
    return src_tokens.gather(1, index)


def fill_with_neg_inf(t: torch.Tensor) -> torch.Tensor:
    """FP16-compatible fill of `t` with -inf."""
    return t.float().fill_(float("-inf")).type_as(t)


def log_softmax(x: torch.Tensor, dim: int, onnx_trace: bool = False) -> torch.Tensor:
    """log-softmax computed in fp32 (upstream's rule for numerical stability)."""
    return F.log_softmax(x.float(), dim=dim, dtype=torch.float32)


def softmax(x: torch.Tensor, dim: int, onnx_trace: bool = False) -> torch.Tensor:
    return F.softmax(x.float(), dim=dim, dtype=torch.float32)


def get_activation_fn(activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return activations.get_activation_fn(activation)


def get_available_activation_fns() -> List[str]:
    return list(activations.ACTIVATION_FNS)


def clip_grad_norm_(params, max_norm: float, aggregate_norm_fn: Optional[Callable] = None) -> torch.Tensor:
    """Clip gradients to a global L2 norm of `max_norm` (<= 0: only measure); returns the norm before
    clipping. The trainer's clipping (also right for FSDP2's sharded gradients)."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    return parallelize.clip_grad_norm_(params, max_norm, aggregate_norm_fn=aggregate_norm_fn)


def has_parameters(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


# ------------------------------------------------------------------------------------------ samples


def apply_to_sample(f: Callable, sample):
    """`f` applied to every tensor of a (nested dict / list / tuple / set) sample; an empty one is kept."""
    if hasattr(sample, "__len__") and len(sample) == 0:
        return {}

    def apply(x):
        if torch.is_tensor(x):
            return f(x)
        if isinstance(x, dict):
            return type(x)((k, apply(v)) for k, v in x.items())
        if isinstance(x, list):
            return [apply(v) for v in x]
        if isinstance(x, tuple):
            return tuple(apply(v) for v in x)
        if isinstance(x, set):
            return {apply(v) for v in x}
        return x

    return apply(sample)


def move_to_cuda(sample, device: Optional[torch.device] = None):
    device = device if device is not None else torch.cuda.current_device()
    return apply_to_sample(lambda t: t.to(device=device, non_blocking=True), sample)


def move_to_cpu(sample):
    # fp16 tensors become fp32 on the CPU, as upstream (CPU half ops are slow or missing)
    return apply_to_sample(lambda t: t.cpu().float() if t.dtype in (torch.float16, torch.bfloat16) else t.cpu(), sample)


# ----------------------------------------------------------------------------------- random state


def get_rng_state() -> dict:
    state = {"torch_rng_state": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])


class set_torch_seed:
    """Seed torch (and CUDA) with `seed`; as a context manager, the previous random state comes back at exit."""

    def __init__(self, seed: int):
        if not isinstance(seed, int):
            raise TypeError(f"set_torch_seed needs an int seed, got {type(seed).__name__}")
        self.rng_state = get_rng_state()
        torch.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed(seed)

    def __enter__(self) -> "set_torch_seed":
        return self

    def __exit__(self, *exc) -> None:
        set_rng_state(self.rng_state)


# ------------------------------------------------------------------------------ positions, configs


def split_paths(paths: str, separator: str = os.pathsep) -> List[str]:
    """DATA's directories (`path1:path2`); a URL (`s3://...`) is split on `|` instead, as upstream."""
    return paths.split(separator) if "://" not in paths else paths.split("|")


def safe_getattr(obj, name: str, default: Any = None):
    """getattr that also gives `default` for an attribute set to None (upstream's)."""
    value = getattr(obj, name, default)
    return default if value is None else value


def safe_hasattr(obj, name: str) -> bool:
    return getattr(obj, name, None) is not None


def eval_str_list(x, type=float):
    if x is None:
        return None
    if isinstance(x, str):
        x = ast.literal_eval(x)
    try:
        return list(map(type, x))
    except TypeError:
        return [type(x)]


def eval_str_dict(x, type=dict):
    if x is None:
        return None
    if isinstance(x, str):
        x = ast.literal_eval(x)
    return x


def eval_bool(x, default: bool = False) -> bool:
    if x is None:
        return default
    try:
        return bool(ast.literal_eval(x))
    except (ValueError, SyntaxError, TypeError):
        return default


def csv_str_list(x: str) -> List[str]:
    return x.split(",")


def deprecation_warning(message: str, stacklevel: int = 3) -> None:
    warnings.warn(message, stacklevel=stacklevel)


def get_incremental_state(module, incremental_state, key: str):
    """Upstream's helper for a module's own entry of an incremental decoding state."""
    return module.get_incremental_state(incremental_state, key)


def set_incremental_state(module, incremental_state, key: str, value):
    return module.set_incremental_state(incremental_state, key, value)


def __getattr__(name):
    absent_name("fairseq.utils", name)
