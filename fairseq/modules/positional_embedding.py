"""Position embeddings with upstream fairseq's padding offset.

Positions are counted over non-padding tokens and start at `padding_idx + 1`; padding tokens get position
`padding_idx`, whose row is zero. So a table for `max_positions` positions has
`max_positions + padding_idx + 1` rows, which is what upstream checkpoints hold.

Incremental decoding (see TransformerDecoder) reads `embed_range(start, length)`: the rows of tokens
start .. start + length - 1 of a sequence without padding (position = padding_idx + 1 + index), a slice of
the table with no index tensor; the static one-token step (CUDA graphs) reads `embed_slots(slots)`, the same
rows for indices held in a device tensor. `forward(tokens, incremental_state=...)` keeps upstream's rule for
callers that pass the whole prefix: the position of its last token, padding_idx + tokens.size(1), for every
row (pads are not skipped there, as upstream does not skip them).
"""

import math
from typing import Optional

from torch import Tensor

import torch
import torch.nn as nn
import torch.nn.functional as F


def make_positions(tokens: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """Position ids [B, T]: padding_idx + 1, + 2, ... over non-pad tokens; padding_idx at pads."""
    not_pad = tokens.ne(padding_idx).long()
    return torch.cumsum(not_pad, dim=1) * not_pad + padding_idx


def sinusoidal_table(
    num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None, device=None
) -> torch.Tensor:
    """Upstream's sinusoidal table [num_embeddings, embedding_dim] (float32).

    Row p is [sin(p * f_0) .. sin(p * f_{h-1}), cos(p * f_0) .. cos(p * f_{h-1})] with h = dim // 2 and
    f_i = exp(-i * ln(10000) / (h - 1)); an odd dim gets a zero last column; the padding row is zero.
    """
    half_dim = embedding_dim // 2
    if half_dim < 2:
        raise ValueError(f"sinusoidal positions need an embedding dim of at least 4, got {embedding_dim}")
    step = math.log(10000) / (half_dim - 1)
    freqs = torch.exp(torch.arange(half_dim, dtype=torch.float32, device=device) * -step)
    angles = torch.arange(num_embeddings, dtype=torch.float32, device=device).unsqueeze(1) * freqs.unsqueeze(0)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if embedding_dim % 2 == 1:
        table = torch.cat([table, table.new_zeros(num_embeddings, 1)], dim=1)
    if padding_idx is not None:
        table[padding_idx] = 0
    return table


def zero_row_(weight: torch.Tensor, row: int) -> None:
    """weight[row] = 0 in place, with whole-tensor ops only.

    Indexing one row of a sharded parameter (FSDP2's DTensor) writes to a temporary copy and leaves the
    parameter unchanged; a row mask built from the tensor itself is applied shard by shard.
    """
    with torch.no_grad():
        row_ids = torch.cumsum(torch.ones_like(weight[:, :1], dtype=torch.long), dim=0) - 1
        weight.mul_(row_ids.ne(row))


class LearnedPositionalEmbedding(nn.Embedding):
    """Learned positions for up to `max_positions` tokens (rows include the padding offset)."""

    def __init__(self, max_positions: int, embedding_dim: int, padding_idx: int):
        super().__init__(max_positions + padding_idx + 1, embedding_dim, padding_idx=padding_idx)
        self.max_positions = max_positions

    def reset_parameters(self):
        nn.init.normal_(self.weight, mean=0.0, std=self.embedding_dim**-0.5)
        zero_row_(self.weight, self.padding_idx)

    def _check_length(self, length: int) -> None:
        if length > self.max_positions:
            raise ValueError(
                f"input of {length} tokens is longer than the {self.max_positions} learned positions; "
                "lower --tokens-per-sample or build the model with a larger --max-target-positions"
            )

    def forward(
        self, tokens: torch.Tensor, incremental_state: Optional[dict] = None, positions: Optional[Tensor] = None
    ) -> torch.Tensor:
        if positions is not None:
            return F.embedding(positions, self.weight, self.padding_idx)
        if incremental_state is not None:
            return _last_position(self, tokens)
        self._check_length(tokens.size(1))
        return F.embedding(make_positions(tokens, self.padding_idx), self.weight, self.padding_idx)

    def embed_range(self, start: int, length: int) -> torch.Tensor:
        """[length, dim]: the positions of tokens start .. start + length - 1 of an unpadded sequence."""
        self._check_length(start + length)
        first = self.padding_idx + 1 + start
        return self.weight[first : first + length]

    def embed_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """[n, dim]: the positions of tokens at indices `slots` (a long tensor) of an unpadded sequence. Not
        checked against the table (that would read the device tensor): the caller keeps them below max_positions."""
        return F.embedding(slots + (self.padding_idx + 1), self.weight)


class SinusoidalPositionalEmbedding(nn.Module):
    """Fixed sinusoidal positions of any length; the table is recomputed, never saved.

    `_float_tensor` is a one-element buffer that upstream keeps in its state dicts; it is kept so that
    state dicts load both ways.
    """

    max_positions = 100_000  # upstream's nominal limit

    def __init__(self, embedding_dim: int, padding_idx: int, init_size: int = 1024):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.init_size = init_size
        self.register_buffer("table", sinusoidal_table(init_size, embedding_dim, padding_idx), persistent=False)
        self.register_buffer("_float_tensor", torch.zeros(1))

    def reset_parameters(self):
        with torch.no_grad():
            self.table.copy_(
                sinusoidal_table(self.init_size, self.embedding_dim, self.padding_idx, device=self.table.device)
            )
            self._float_tensor.zero_()

    def forward(
        self, tokens: torch.Tensor, incremental_state: Optional[dict] = None, positions: Optional[Tensor] = None
    ) -> torch.Tensor:
        if incremental_state is not None and positions is None:
            return _last_position(self, tokens)
        table = self.table
        rows_needed = self.padding_idx + 1 + tokens.size(1)
        if positions is not None:
            rows_needed = max(rows_needed, int(positions.max()) + 1)
        if rows_needed > table.size(0):  # longer than the precomputed table: compute a bigger one
            table = sinusoidal_table(rows_needed, self.embedding_dim, self.padding_idx, device=tokens.device).to(
                table.dtype
            )
        if positions is None:
            positions = make_positions(tokens, self.padding_idx)
        return F.embedding(positions, table)

    def embed_range(self, start: int, length: int) -> torch.Tensor:
        """[length, dim]: the positions of tokens start .. start + length - 1 of an unpadded sequence."""
        first = self.padding_idx + 1 + start
        if first + length > self.table.size(0):
            # Decoding past the table: keep a larger one (doubling), so later steps slice it again.
            rows = max(first + length, 2 * self.table.size(0))
            self.table = sinusoidal_table(rows, self.embedding_dim, self.padding_idx, device=self.table.device).to(
                self.table.dtype
            )
        return self.table[first : first + length]

    def embed_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """[n, dim]: the positions of tokens at indices `slots` (a long tensor) of an unpadded sequence. The table
        is not grown here (its address must not change under a CUDA graph): it already covers the decoder's
        max_positions, which the caller keeps `slots` below."""
        return F.embedding(slots + (self.padding_idx + 1), self.table)


def _last_position(module, tokens: torch.Tensor) -> torch.Tensor:
    """Upstream's incremental rule: [B, 1, dim], the position padding_idx + T of the last of T tokens."""
    return module.embed_range(tokens.size(1) - 1, 1).unsqueeze(0).expand(tokens.size(0), 1, -1)


def build_positional_embedding(max_positions: int, embedding_dim: int, padding_idx: int, learned: bool = False):
    """Learned or sinusoidal positions sized as upstream sizes them."""
    if learned:
        return LearnedPositionalEmbedding(max_positions, embedding_dim, padding_idx)
    return SinusoidalPositionalEmbedding(embedding_dim, padding_idx, init_size=max_positions + padding_idx + 1)


def PositionalEmbedding(num_embeddings: int, embedding_dim: int, padding_idx: int, learned: bool = False):
    """Upstream's factory under its name and arguments: positions for `num_embeddings` tokens (the table has the
    padding offset's rows on top, as upstream's)."""
    return build_positional_embedding(num_embeddings, embedding_dim, padding_idx, learned=learned)
