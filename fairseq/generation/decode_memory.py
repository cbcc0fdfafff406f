"""Will a generation batch fit on the GPU? The bytes of the models' weights and of the KV cache a batch reserves,
checked against what the device has, before the batch is decoded.

The KV cache of one row (a sentence's hypothesis) holds, per cached position, a key and a value of every
attention layer: `2 x layers x embed_dim x dtype bytes` (`kv_cache_bytes`). The generator reserves it for the
longest output it allows: the prompt counts (upstream's rule for language models), so a batch whose widest prompt
is `x` tokens reserves `min(max_len_a * x + max_len_b, positions - 1) + 1` positions (`decode_positions`: the
output's tokens and the </s> it starts from) for each of its `sentences x beam` rows.

`check_decode_memory` compares weights + cache with what CUDA reports free (torch.cuda.mem_get_info) plus what
this process's caching allocator already holds (the weights themselves, earlier batches' caches: memory it may
reuse), so the caches the generator keeps between batches never make a batch look too large. The figure is a
lower bound (activations, logits, the CUDA graphs' pools and the allocator's rounding come on top): a batch it
refuses cannot run; one it lets through may still run out of memory when the device is nearly full. On the CPU
nothing is checked.
"""

import math
from typing import Iterable, Optional, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fairseq.modules import CausalSelfAttention

GiB = 1024**3


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor's storage holds; a tensor subclass that wraps others (torchao's quantized weights) counts
    the tensors it wraps (an int8 weight is 1 byte per value plus its scales, though its dtype reads bf16)."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names if getattr(tensor, name) is not None)
    return tensor.numel() * tensor.element_size()


def model_bytes(models: Iterable[nn.Module], device: Optional[torch.device] = None) -> int:
    """Bytes of the parameters and buffers of `models` (each shared tensor once); with `device`, only of those
    not on it yet (what moving the models there adds)."""
    seen, total = set(), 0
    for model in models:
        for tensor in list(model.parameters()) + list(model.buffers()):
            if id(tensor) in seen or (device is not None and tensor.device == device):
                continue
            seen.add(id(tensor))
            total += tensor_bytes(tensor)
    return total


def kv_cache_bytes(rows: int, positions: int, layers: int, embed_dim: int, dtype_bytes: int) -> int:
    """Bytes of a KV cache of `rows` (sentences x beam) x `positions`: a key and a value of `embed_dim` values
    per layer and position."""
    return rows * positions * layers * 2 * embed_dim * dtype_bytes


def attention_shape(model: nn.Module) -> Tuple[int, int]:
    """(layers with a KV cache, the width of their keys): the model's causal self-attention modules (the
    widest one's cached heads x head_dim: this rank's under tensor parallelism); (0, 0) for a model without them
    (fconv_lm keeps no KV cache)."""
    widths = [m.cached_heads() * m.head_dim for m in model.modules() if isinstance(m, CausalSelfAttention)]
    return len(widths), max(widths, default=0)


def longest_output(prompt_width: int, max_len_a: float, max_len_b: int, max_positions: Optional[int]) -> int:
    """The generator's length rule: the most tokens an output of prompts `prompt_width` wide has before </s>,
    the prompt included (upstream's rule for language models), capped at `max_positions` - 1."""
    longest = int(max_len_a * prompt_width + max_len_b)
    return longest if max_positions is None else min(longest, max_positions - 1)


def check_output_length(
    longest: int, min_len: int, prompt_width: int, max_len_a: float, max_len_b: int, max_positions: int
) -> None:
    """ValueError when no output can be generated: the length rule (longest_output, here `longest`) gives fewer
    than 0 tokens (--max-len-b's fault), or fewer than --min-len."""
    rule = f"--max-len-a {max_len_a} * {prompt_width} + --max-len-b {max_len_b}"
    if longest < 0:
        raise ValueError(
            f"--max-len-b {max_len_b} makes the longest output {longest} tokens ({rule}), below 0; raise "
            f"--max-len-b to at least {math.ceil(max(min_len, 0) - max_len_a * prompt_width)}"
        )
    if min_len > longest:
        raise ValueError(
            f"--min-len {min_len} is larger than the longest output allowed, {longest} tokens "
            f"(min({rule}, {max_positions - 1})); lower --min-len or raise --max-len-b"
        )


def decode_positions(prompt_width: int, max_len_a: float, max_len_b: int, max_positions: Optional[int]) -> int:
    """Positions the generator's cache reserves per row for prompts `prompt_width` wide: the longest output
    and the </s> it starts from."""
    return longest_output(prompt_width, max_len_a, max_len_b, max_positions) + 1


def decode_bytes(models: Iterable[nn.Module], rows: int, positions: int) -> int:
    """KV cache bytes of `rows` x `positions` for every model of an ensemble, in each model's dtype."""
    total = 0
    for model in models:
        layers, width = attention_shape(model)
        dtype_bytes = next(iter(model.parameters())).element_size()  # a quantized weight reads as its dtype
        total += kv_cache_bytes(rows, positions, layers, width, dtype_bytes)
    return total


def decode_memory_error(
    models, sentences: int, beam: int, positions: int, available: int, where: str, fix: str
) -> Optional[str]:
    """The one-line error when `sentences x beam` rows of `positions` and the models' weights need more than
    `available` bytes on device `where`; None when they fit."""
    models = list(models)
    cache = decode_bytes(models, sentences * beam, positions)
    weights = model_bytes(models)
    if weights + cache <= available:
        return None
    layers, width = attention_shape(models[0])
    return (
        f"a batch of {sentences} prompt(s) x beam {beam} x {positions} positions needs {cache / GiB:.2f} GiB of "
        f"KV cache ({layers} layers x 2 x {width} values per position) besides {weights / GiB:.2f} GiB of "
        f"weights, more than the {available / GiB:.2f} GiB {where} has for this process (free + held by torch); "
        f"{fix}"
    )


def check_decode_memory(
    models,
    sentences: int,
    beam: int,
    positions: int,
    device: torch.device,
    fix: str = "lower --batch-size / --max-tokens, --beam or --max-len-b",
) -> None:
    """ValueError, one line, when `sentences x beam` rows of `positions` do not fit on CUDA `device` with the
    models' weights (see the module doc); nothing on other devices."""
    if device.type != "cuda":
        return
    error = decode_memory_error(models, sentences, beam, positions, _available(device), str(device), fix)
    if error:
        raise ValueError(error)


def _available(device: torch.device) -> int:
    """Bytes this process may use on CUDA `device`: free, plus what its caching allocator holds (the weights
    already there, earlier batches' caches)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def kv_positions_that_fit(models, device: torch.device) -> Optional[int]:
    """How many cache positions (rows x positions per row) fit on CUDA `device` beside the models' weights, by
    the check above (a bound: activations and graphs come on top); None on other devices. What a server's
    --max-batch-tokens and a decode engine's max_rows x max_positions stay under."""
    if device.type != "cuda":
        return None
    models = list(models)
    per_position = decode_bytes(models, 1, 1)
    if per_position == 0:
        return None
    return max(0, (_available(device) - model_bytes(models)) // per_position)
