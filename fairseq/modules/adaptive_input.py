"""Adaptive input embeddings (Baevski & Auli, 2019, https://arxiv.org/abs/1809.10853), `--adaptive-input`.

The vocabulary (ordered by frequency, as fairseq's dictionaries are) is cut into bands at
`--adaptive-input-cutoff`: band i holds ids [cutoff[i-1], cutoff[i]) and embeds them at width
`initial_dim // factor**i`, then projects them to the model width. Parameter names are upstream's, so
upstream checkpoints load: `embeddings.N.0.weight` (band N's table, [band size, band dim]),
`embeddings.N.1.weight` (its projection, [output_dim, band dim]) and the `_float_tensor` buffer.
"""

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from fairseq.modules.positional_embedding import zero_row_
from fairseq.dataclass.flag_values import literal_or_none


def parse_cutoffs(value: Union[str, int, Sequence[int], None], flag: str) -> Optional[List[int]]:
    """`--adaptive-*-cutoff` as upstream writes it ("20000,60000", "[20000, 60000]" or numbers) -> [ints].

    Raises ValueError naming `flag` unless the values are positive and increasing."""
    if value is None:
        return None
    parsed = literal_or_none(value)
    if isinstance(parsed, int) and not isinstance(parsed, bool):
        parsed = [parsed]
    if (
        not isinstance(parsed, (list, tuple))
        or not parsed
        or not all(isinstance(c, int) and not isinstance(c, bool) for c in parsed)
    ):
        raise ValueError(f"{flag} {value!r} is not a list of integers; pass it as {flag} 20000,60000")
    cutoffs = [int(c) for c in parsed]
    if cutoffs[0] <= 0 or any(b <= a for a, b in zip(cutoffs, cutoffs[1:])):
        raise ValueError(f"{flag} {value!r}: the cutoffs must be positive and increasing, e.g. 20000,60000")
    return cutoffs


def band_edges(cutoffs: Sequence[int], vocab_size: int, flag: str) -> List[int]:
    """The cutoffs with the vocabulary size appended (upstream's rule: the last band ends at the vocabulary,
    and a last cutoff equal to it is allowed); a cutoff beyond the vocabulary is a ValueError naming `flag`."""
    cutoffs = list(cutoffs)
    if cutoffs[-1] > vocab_size:
        raise ValueError(
            f"{flag} {','.join(map(str, cutoffs))}: the last cutoff is larger than the vocabulary "
            f"({vocab_size} symbols); pass cutoffs below the dictionary size"
        )
    return cutoffs if cutoffs[-1] == vocab_size else cutoffs + [vocab_size]


def band_dims(initial_dim: int, factor: float, count: int, first_power: int, flag: str) -> List[int]:
    """Widths `int(initial_dim // factor**(first_power + i))` of `count` bands (upstream's formula); a width
    below 1 is a ValueError naming `flag` (the factor)."""
    dims = [int(initial_dim // factor ** (first_power + i)) for i in range(count)]
    if factor <= 0 or min(dims) < 1:
        raise ValueError(
            f"{flag} {factor}: the bands' widths {dims} (dim // factor**i) must be at least 1; "
            "pass a smaller factor or fewer cutoffs"
        )
    return dims


class AdaptiveInput(nn.Module):
    """Token ids [*] -> embeddings [*, output_dim]; `embedding_dim` is `output_dim`, as for nn.Embedding."""

    def __init__(
        self,
        vocab_size: int,
        padding_idx: int,
        initial_dim: int,
        factor: float,
        output_dim: int,
        cutoff: List[int],
        q_noise: float = 0,
        qn_block_size: int = 8,
    ):
        super().__init__()
        if q_noise:
            raise ValueError("--quant-noise-pq is not supported by this fairseq; leave it at 0")
        self.cutoff = band_edges(cutoff, vocab_size, "--adaptive-input-cutoff")
        if padding_idx is not None and padding_idx >= self.cutoff[0]:
            raise ValueError(
                f"--adaptive-input-cutoff {','.join(map(str, cutoff))}: the first cutoff must be larger "
                f"than the padding index {padding_idx} (the first band holds the padding symbol)"
            )
        self.embedding_dim = output_dim
        self.padding_idx = padding_idx
        dims = band_dims(initial_dim, factor, len(self.cutoff), 0, "--adaptive-input-factor")
        self.embeddings = nn.ModuleList()
        for i, dim in enumerate(dims):
            size = self.cutoff[i] - (self.cutoff[i - 1] if i > 0 else 0)
            # Only band 0 holds the padding symbol (its row gets no gradient), as upstream.
            self.embeddings.append(
                nn.Sequential(
                    nn.Embedding(size, dim, padding_idx if i == 0 else None), nn.Linear(dim, output_dim, bias=False)
                )
            )
        # Unused here; kept so that the state dict has upstream's keys (and upstream can load ours).
        self.register_buffer("_float_tensor", torch.zeros(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Upstream's initialization: tables ~ N(0, dim**-0.5) with row `padding_idx` zeroed in every band
        (upstream does that in each band, not only where the padding symbol is), projections Xavier-uniform."""
        for table, projection in self.embeddings:
            nn.init.normal_(table.weight, mean=0.0, std=table.weight.shape[1] ** -0.5)
            if self.padding_idx is not None and self.padding_idx < table.weight.shape[0]:
                zero_row_(table.weight, self.padding_idx)
            nn.init.xavier_uniform_(projection.weight)
        with torch.no_grad():
            self._float_tensor.zero_()

    def weights_for_band(self, band: int) -> Tuple[nn.Parameter, nn.Parameter]:
        """(table [band size, band dim], projection [output_dim, band dim]) of `band` (what the adaptive
        softmax ties to)."""
        return self.embeddings[band][0].weight, self.embeddings[band][1].weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Every band embeds every token (ids clamped into the band) and each position keeps its own band's
        # vector: no data-dependent shapes (no host synchronization), and every parameter takes part in every
        # step (DDP without find_unused_parameters). Tokens outside a band get exactly zero gradient from it.
        result = None
        start = 0
        for end, band in zip(self.cutoff, self.embeddings):
            local = (tokens - start).clamp(0, end - start - 1)
            embedded = band(local)
            if result is None:
                result = embedded
            else:
                in_band = (tokens >= start) & (tokens < end)
                result = torch.where(in_band.unsqueeze(-1), embedded, result)
            start = end
        return result
