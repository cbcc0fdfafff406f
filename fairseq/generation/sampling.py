"""What every sampler shares: the top-k / top-p filter, and counter-based draws that depend on a seed, a sentence
and a step only (not on the batch a sentence is decoded in).

`top_k_top_p(lprobs, top_k, top_p)` is the one filter: `search.Sampling` (torch's RNG, upstream's draws), the
device loop's sampling (fairseq.generation.device_decoding) and the decode engine (fairseq.generation.engine,
per-row options) all keep their candidates through it.

Counter-based draws: the Gumbel noise of token v at step s of a sentence with key k is a hash of (k, s, v), the key
a hash of (seed, sentence id). The drawn token is the argmax of log-probability plus noise over the kept tokens,
which draws from the kept tokens' renormalized distribution, as a multinomial over their probabilities does.
"""

import math
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_HASH_MULTIPLIER = 0x45D9F3B  # a 32-bit integer hash's multiplier (< 2**27: products stay inside int64)


def top_k_top_p(
    lprobs: Tensor, top_k: Union[int, Tensor], top_p: Union[float, Tensor]
) -> Tuple[Tensor, Optional[Tensor]]:
    """The candidates of a draw over the last dimension of `lprobs` (log-probabilities): (their log-probabilities,
    -inf for those filtered out; their token ids, None when they are the whole vocabulary in order).

    With numbers: top_p > 0 keeps, in decreasing probability, the tokens before the cumulative mass reaches p
    and the one that crosses it (sorted candidates, not truncated: truncating would read the device); else
    top_k > 0 keeps the k most likely (torch.topk); else every token. Callers that follow upstream (top-p wins
    when both are set) pass one of them. With per-row tensors ([rows], top_k <= 0 and top_p <= 0 or >= 1 meaning
    off), both filters apply, over the sorted vocabulary (what rows with different options need)."""
    if torch.is_tensor(top_k) or torch.is_tensor(top_p):
        return _per_row(lprobs, top_k, top_p)
    if top_p > 0:
        _, ids = lprobs.exp().sort(dim=-1, descending=True)
        candidates = lprobs.gather(-1, ids)
        return candidates.masked_fill(_mass_before(candidates) >= top_p, -math.inf), ids
    if top_k > 0:
        return lprobs.topk(top_k)
    return lprobs, None


def _mass_before(sorted_lprobs: Tensor) -> Tensor:
    """The probability mass of the candidates before each one (sorted in decreasing order)."""
    return F.pad(sorted_lprobs.exp().cumsum(dim=-1)[..., :-1], (1, 0))


def _per_row(lprobs: Tensor, top_k: Tensor, top_p: Tensor) -> Tuple[Tensor, Tensor]:
    candidates, ids = lprobs.sort(dim=-1, descending=True)
    rank = torch.arange(lprobs.size(-1), device=lprobs.device)
    k = top_k.view(-1, 1)
    p = top_p.view(-1, 1).to(candidates.dtype)
    drop = (k.gt(0) & rank.ge(k)) | (p.gt(0) & p.lt(1) & _mass_before(candidates).ge(p))
    return candidates.masked_fill(drop, -math.inf), ids


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash of each element of x (int64 holding values in [0, 2**32))."""
    x = ((x >> 16) ^ x) * _HASH_MULTIPLIER & _MASK32
    x = ((x >> 16) ^ x) * _HASH_MULTIPLIER & _MASK32
    return (x >> 16) ^ x


def sentence_keys(seed: Union[int, Tensor], sentence_ids: Tensor) -> Tensor:
    """The sampling key [B] (int64) of each sentence: a hash of the seed (an int, or one per sentence) and the
    sentence's id."""
    if not torch.is_tensor(seed):
        seed = seed & _MASK32  # torch.initial_seed() may not fit an int64
    seed32 = torch.as_tensor(seed, dtype=torch.long, device=sentence_ids.device) & _MASK32
    return _mix32(_mix32(sentence_ids.long() & _MASK32) ^ _mix32(seed32))


def gumbel_noise(keys: Tensor, step: Tensor, token_ids: Tensor) -> Tensor:
    """Standard Gumbel noise [R, N] (fp32) for tokens `token_ids` [R, N] (or [N]) at `step` ([1] or [R, 1], a
    device tensor) of the rows with sampling keys `keys` [R]: a pure function of (key, step, token)."""
    at_step = _mix32((keys + _mix32((step.view(-1) + 0x9E3779B9) & _MASK32)) & _MASK32)
    bits = _mix32(at_step.unsqueeze(1) ^ token_ids)
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1), 24 random bits
    return -torch.log(-torch.log(uniform))


def draw(lprobs: Tensor, keys: Tensor, step: Tensor, top_k, top_p) -> Tensor:
    """The token [R] drawn for each row from `lprobs` [R, V] filtered by top_k_top_p, with the counter-based
    noise of (keys, step)."""
    candidates, ids = top_k_top_p(lprobs, top_k, top_p)
    if ids is None:
        ids = torch.arange(lprobs.size(-1), device=lprobs.device).expand_as(lprobs)
    drawn = (candidates + gumbel_noise(keys, step, ids)).argmax(dim=-1, keepdim=True)
    return ids.gather(-1, drawn).squeeze(-1)
