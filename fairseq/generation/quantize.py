"""Weight-only int8 for generation (`--quantize int8-weight-only`), through torchao.

`quantize_for_generation(model, mode, device)` runs after the model is loaded, moved to the GPU and cast to
bf16 (fairseq-generate, fairseq-interactive, the hub's first generate call): each nn.Linear's weight becomes
torchao's `Int8Tensor` (`torchao.quantization.quantize_` with `Int8WeightOnlyConfig`: symmetric int8, one scale
per output row), so the weights take 1 byte per value instead of 2; activations, the KV cache, embeddings and
norms stay bf16. A Linear whose weight is shared with another module (the output projection tied to the token
embeddings, `--share-decoder-input-output-embed`) is left alone: quantizing it would untie the two.

Where it helps: decoding a few rows at a time reads every weight once per token, so the step is bound by memory
bandwidth and half the weight bytes is the gain to be had. torchao's eager int8 linear converts the int8 weight
to the activations' dtype before the matmul, so the bytes saved per step depend on the step being compiled
(inductor fuses the conversion into the matmul); the replayed CUDA-graph step runs the eager kernels. Measure
it with `scripts/benchmark_generate.py` (its `int8-weight-only` row), docs/benchmarks.md.

The rules, each an error naming the flag and the fix, checked before anything is loaded (`check_quantize`):
torchao must be installed (the `quantize` extra), the device must be CUDA (weight-only int8 is a GPU decoding
feature here: on the CPU it would only be slower), and the model bf16 (`--bf16`): in fp16 the int8 weights
(up to 127) multiply the activations before the scale does, which can overflow fp16's 65504; in fp32 there is
nothing to gain. Training with quantized weights is not supported (fairseq-train has no such flag).
"""

import importlib
import logging
from typing import Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

MODES = ("none", "int8-weight-only")
EXTRA = "pip install 'fairseq[quantize]' (or pip install torchao)"


def _flag(mode: str, keyword: bool) -> str:
    return f"quantize={mode!r}" if keyword else f"--quantize {mode}"


def check_mode(mode: Optional[str], keyword: bool = False) -> None:
    """ValueError naming the flag (or keyword) for a mode that is not one of MODES."""
    if (mode or "none") not in MODES:
        raise ValueError(f"{_flag(mode, keyword)} is no quantization mode: choose one of {', '.join(MODES)}")


def check_quantize(mode: Optional[str], device: torch.device, dtype: torch.dtype, keyword: bool = False) -> None:
    """ValueError, one line, when `mode` cannot run on `device` in `dtype` (the module doc's rules), before any
    model is loaded. `keyword`: name the hub's keyword argument instead of the flag."""
    mode = mode or "none"
    flag = _flag(mode, keyword)
    check_mode(mode, keyword)
    if mode == "none":
        return
    try:
        importlib.import_module("torchao.quantization")
    except ImportError:
        raise ValueError(f"{flag} needs torchao, which is not installed: {EXTRA}") from None
    if torch.device(device).type != "cuda":
        fix = ("move the model to a GPU before generating (lm.cuda()) or drop quantize=" if keyword
               else "run on a GPU (drop --cpu) or drop --quantize")
        raise ValueError(f"{flag} is a CUDA decoding feature (int8 weights save GPU memory bandwidth; on the CPU "
                         f"they are only slower): {fix}")
    if dtype != torch.bfloat16:
        cast = "lm.to(torch.bfloat16)" if keyword else "--bf16"
        why = ("in fp16 the int8 values (up to 127) times the activations can overflow before the scale applies"
               if dtype == torch.float16 else "an fp32 model gains nothing from int8 weights")
        raise ValueError(f"{flag} needs a bf16 model ({why}): {'cast it with ' if keyword else 'pass '}{cast}")


def quantizable_linears(model: nn.Module) -> list:
    """Names of the nn.Linear modules whose weight is theirs alone (a tied output projection is left out)."""
    owners = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(name)
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and len(owners.get(id(module.weight), ())) == 1]


def quantize_for_generation(model: nn.Module, mode: Optional[str], device: torch.device,
                            keyword: bool = False) -> int:
    """Quantize `model` (on `device`, cast already) in place for generation; returns how many Linear weights
    became int8 (0 for mode "none" or None). Raises ValueError (check_quantize) when it cannot."""
    mode = mode or "none"
    dtype = next(iter(model.parameters())).dtype
    check_quantize(mode, device, dtype, keyword)
    if mode == "none":
        return 0
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    names = set(quantizable_linears(model))
    if not names:  # e.g. fconv_lm, whose weight-normed layers are not nn.Linear
        raise ValueError(f"{_flag(mode, keyword)}: {type(model).__name__} has no nn.Linear weight of its own to "
                         "quantize; drop it for this model")
    # set_inductor_config=False: torchao would otherwise change inductor's global settings for the whole process
    quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False), filter_fn=lambda module, fqn: fqn in names)
    logger.info(f"{_flag(mode, keyword)}: {len(names)} Linear weights are int8 (torchao Int8WeightOnlyConfig)")
    return len(names)


def int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] as torchao's Int8Tensor, as quantize_for_generation stores a Linear's (any device: for
    benchmarks and tests; the flag itself runs on CUDA only)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    linear = nn.Linear(weight.size(1), weight.size(0), bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    quantize_(linear, Int8WeightOnlyConfig(set_inductor_config=False))
    return linear.weight.detach()
