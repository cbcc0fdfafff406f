"""Activation functions selectable with `--activation-fn`, under upstream fairseq's names."""

import warnings
from typing import Callable

import torch
import torch.nn.functional as F

ACTIVATION_FNS = ("relu", "gelu", "gelu_fast", "gelu_accurate", "tanh", "linear")


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    # The tanh approximation of GELU that upstream calls gelu_accurate.
    return F.gelu(x, approximate="tanh")


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


_FUNCTIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_accurate": _gelu_tanh, "tanh": torch.tanh, "linear": _identity}


def get_activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function for an `--activation-fn` value; `gelu_fast` is upstream's old name of gelu_accurate."""
    if name == "gelu_fast":
        warnings.warn(
            "--activation-fn gelu_fast is deprecated; use gelu_accurate (the same function)",
            DeprecationWarning,
            stacklevel=2,
        )
        name = "gelu_accurate"
    if name not in _FUNCTIONS:
        raise ValueError(f"--activation-fn {name!r} is not supported; choose one of: {', '.join(ACTIVATION_FNS)}")
    return _FUNCTIONS[name]
