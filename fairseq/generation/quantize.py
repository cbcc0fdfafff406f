"""Weight-only int8 for generation (`--quantize int8-weight-only`): each Linear's weight in int8, multiplied
by a fused int8 matmul.

`quantize_for_generation(model, mode, device)` runs after the model is loaded, moved to the GPU and cast to
bf16 (fairseq-generate, fairseq-interactive, the hub's first generate call): each nn.Linear becomes an
`Int8WeightOnlyLinear`, its weight stored as int8 with one fp32 scale per output row (symmetric: the row's
largest |value| maps to 127), so the weights take 1 byte per value instead of 2; activations, the KV cache,
embeddings and norms stay bf16. A Linear whose weight is shared with another module (the output projection tied
to the token embeddings, `--share-decoder-input-output-embed`) is left alone: quantizing it would untie the two.

Where it helps: decoding a few rows at a time reads every weight once per token, so the step is bound by memory
bandwidth and half the weight bytes is the gain to be had. The matmul (fairseq.kernels.int8_matmul) reads the
int8 weight and converts it in registers: Triton kernels on CUDA for decode-sized inputs, their launch shape timed
at first use (or, in a compiled step with FAIRSEQ_INT8_MATMUL=inductor, code inductor fuses); a prompt's forward
(many rows, bound by arithmetic) dequantizes the weight for one bf16 GEMM. No bf16 copy of a weight is
kept. Measure it with `scripts/benchmark_generate.py` (its `int8` row and its table of one Linear's paths).

The rules, each an error naming the flag and the fix, checked before anything is loaded (`check_quantize`): the
device must be CUDA (weight-only int8 is a GPU decoding feature here: on the CPU it would only be slower),
the model bf16 (`--bf16`): what the int8 path is built and measured for; in fp32 there is nothing to gain; and
FAIRSEQ_INT8_MATMUL, where set, one of its paths. Training with quantized weights is not supported (fairseq-train
has no such flag).
"""

import logging
from typing import Optional

import torch
from torch import nn

from fairseq.kernels.int8_matmul import check_int8_matmul_path, int8_linear

logger = logging.getLogger(__name__)

MODES = ("none", "int8-weight-only")


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
    check_int8_matmul_path()
    if torch.device(device).type != "cuda":
        fix = (
            "move the model to a GPU before generating (lm.cuda()) or drop quantize="
            if keyword
            else "run on a GPU (drop --cpu) or drop --quantize"
        )
        raise ValueError(
            f"{flag} is a CUDA decoding feature (int8 weights save GPU memory bandwidth; on the CPU "
            f"they are only slower): {fix}"
        )
    if dtype != torch.bfloat16:
        cast = "lm.to(torch.bfloat16)" if keyword else "--bf16"
        why = (
            "int8 decoding is built and measured for bf16 models"
            if dtype == torch.float16
            else "an fp32 model gains nothing from int8 weights"
        )
        raise ValueError(f"{flag} needs a bf16 model ({why}): {'cast it with ' if keyword else 'pass '}{cast}")


def quantizable_linears(model: nn.Module) -> list:
    """Names of the nn.Linear modules whose weight is theirs alone (a tied output projection is left out)."""
    owners = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(name)
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and len(owners.get(id(module.weight), ())) == 1
    ]


def quantize_for_generation(model: nn.Module, mode: Optional[str], device: torch.device, keyword: bool = False) -> int:
    """Quantize `model` (on `device`, cast already) in place for generation; returns how many Linear weights
    became int8 (0 for mode "none" or None). Raises ValueError (check_quantize) when it cannot."""
    mode = mode or "none"
    dtype = next(iter(model.parameters())).dtype
    check_quantize(mode, device, dtype, keyword)
    if mode == "none":
        return 0
    names = quantizable_linears(model)
    if not names:  # e.g. fconv_lm, whose weight-normed layers are not nn.Linear
        raise ValueError(
            f"{_flag(mode, keyword)}: {type(model).__name__} has no nn.Linear weight of its own to "
            "quantize; drop it for this model"
        )
    quantize_linears_(model, names)
    logger.info(f"{_flag(mode, keyword)}: {len(names)} Linear weights are int8")
    return len(names)


def quantize_linears_(model: nn.Module, names) -> None:
    """Replace the nn.Linear modules of `model` named in `names` by Int8WeightOnlyLinear (any device: the flag's
    rules are quantize_for_generation's)."""
    modules = dict(model.named_modules())
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, Int8WeightOnlyLinear(modules[name]))


class Int8WeightOnlyLinear(nn.Module):
    """An nn.Linear's forward with its weight as int8 rows `qweight` [out, in] times fp32 `scale` [out] (the
    row's largest |value| / 127, rounded to nearest), through fairseq.kernels.int8_matmul; the bias as it was."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            weight = linear.weight.detach().float()
            scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
            self.register_buffer("qweight", torch.round(weight / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8))
            self.register_buffer("scale", scale)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.qweight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
