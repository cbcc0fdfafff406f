"""Adaptive softmax (Grave et al., "Efficient softmax approximation for GPUs", https://arxiv.org/abs/1609.04309),
`--adaptive-softmax-cutoff`.

The vocabulary is cut into bands at the cutoffs. The head scores the first band's words plus one cluster per
later band; band i's tail (a projection to `input_dim // factor**(i+1)`, dropout, a projection onto the band's
words) scores the words inside it, so log p(w) = log p_head(cluster of w) + log p_tail(w | cluster). With
`adaptive_inputs` (--tie-adaptive-weights) the tails' word matrices and the head's word rows are the adaptive
input's tables, and with `tie_proj` (--tie-adaptive-proj) the tails' first projections are its projections,
transposed.

Parameter names are upstream's: `head.weight` ([cutoff[0] + tails, input_dim]) or, tied, `head.word_proj.weight`
(or `head.word_proj.0.weight` / `.1.weight` when widths differ) and `head.class_proj.weight`; `tail.N.0.weight`
and `tail.N.2.weight`; the `version` buffer (upstream refuses a file without it) and the tied head's
`_float_tensor` buffer. A tied weight is the adaptive input's own Parameter, registered under both names, as
upstream does.
"""

from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq.modules.adaptive_input import band_dims, band_edges


def _at_least_fp32(scores: torch.Tensor) -> torch.Tensor:
    return scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores


class TiedLinear(nn.Module):
    """x @ weight.T (or x @ weight with `transpose`) for a weight owned by another module."""

    def __init__(self, weight: nn.Parameter, transpose: bool):
        super().__init__()
        self.weight = weight
        self.transpose = transpose

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.t() if self.transpose else self.weight)


class TiedHeadModule(nn.Module):
    """The head when tied: the band-0 words' scores from the adaptive input's table (through a projection
    when the widths differ), then one score per cluster."""

    def __init__(self, weights: Tuple[nn.Parameter, nn.Parameter], input_dim: int, num_classes: int):
        super().__init__()
        tied_emb, _ = weights
        self.num_words, emb_dim = tied_emb.size()
        self.word_proj = TiedLinear(tied_emb, transpose=False)
        if input_dim != emb_dim:
            self.word_proj = nn.Sequential(nn.Linear(input_dim, emb_dim, bias=False), self.word_proj)
        self.class_proj = nn.Linear(input_dim, num_classes, bias=False)
        self.out_dim = self.num_words + num_classes
        self.register_buffer("_float_tensor", torch.zeros(1))  # upstream's layout; unused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.word_proj(x), self.class_proj(x)], dim=-1)


class AdaptiveSoftmax(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        input_dim: int,
        cutoff: List[int],
        dropout: float,
        factor: float = 4.0,
        adaptive_inputs=None,
        tie_proj: bool = False,
        q_noise: float = 0,
        qn_block_size: int = 8,
    ):
        super().__init__()
        if q_noise:
            raise ValueError("--quant-noise-pq is not supported by this fairseq; leave it at 0")
        self.cutoff = band_edges(cutoff, vocab_size, "--adaptive-softmax-cutoff")
        self.vocab_size = vocab_size
        self.input_dim = input_dim
        self.factor = factor
        self.dropout = dropout
        num_tails = len(self.cutoff) - 1
        if adaptive_inputs is not None:
            if len(adaptive_inputs.cutoff) != len(self.cutoff) or adaptive_inputs.cutoff != self.cutoff:
                raise ValueError(
                    "--tie-adaptive-weights needs --adaptive-input-cutoff equal to "
                    "--adaptive-softmax-cutoff (the tied bands must be the same words)"
                )
            self.head = TiedHeadModule(adaptive_inputs.weights_for_band(0), input_dim, num_tails)
        else:
            self.head = nn.Linear(input_dim, self.cutoff[0] + num_tails, bias=False)
        dims = band_dims(input_dim, factor, num_tails, 1, "--adaptive-softmax-factor") if num_tails else []
        self.tail = nn.ModuleList()
        for i, dim in enumerate(dims):
            size = self.cutoff[i + 1] - self.cutoff[i]
            if adaptive_inputs is not None:
                table, projection = adaptive_inputs.weights_for_band(i + 1)  # [size, d_i], [output_dim, d_i]
                proj = (
                    TiedLinear(projection, transpose=True)
                    if tie_proj
                    else nn.Linear(projection.size(0), projection.size(1), bias=False)
                )
                out_proj = TiedLinear(table, transpose=False)
            else:
                proj = nn.Linear(input_dim, dim, bias=False)
                out_proj = nn.Linear(dim, size, bias=False)
            self.tail.append(nn.Sequential(proj, nn.Dropout(dropout), out_proj))
        self.register_buffer("version", torch.LongTensor([1]))
        self.reset_parameters()

    def _own_linears(self):
        # Tied weights belong to the adaptive input, which initializes them.
        return [m for m in self.modules() if isinstance(m, nn.Linear)]

    def reset_parameters(self) -> None:
        """Upstream's initialization: Xavier-uniform for every weight of its own."""
        for linear in self._own_linears():
            nn.init.xavier_uniform_(linear.weight)
        with torch.no_grad():
            self.version.fill_(1)
            if isinstance(self.head, TiedHeadModule):
                self.head._float_tensor.zero_()

    # ---- upstream's training interface ---------------------------------------------------------------
    def adapt_target(self, target: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """([head target, then each tail's target relative to its band], [rows of each tail's words]).

        The head target replaces a word of band i+1 by its cluster, `cutoff[0] + i`. Unlike upstream, a tail
        without words in `target` gets empty tensors, not None: every tail then runs (on no rows), so every
        parameter has a gradient each step, as DistributedDataParallel needs."""
        target = target.reshape(-1)
        head_target = target.clone()
        tail_targets, rows = [], []
        for i in range(len(self.cutoff) - 1):
            in_band = (target >= self.cutoff[i]) & (target < self.cutoff[i + 1])
            head_target.masked_fill_(in_band, self.cutoff[0] + i)
            band_rows = in_band.nonzero(as_tuple=False).squeeze(1)
            rows.append(band_rows)
            tail_targets.append(target.index_select(0, band_rows) - self.cutoff[i])
        return [head_target] + tail_targets, rows

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """input [B, T, D] and target [B, T] -> (scores: [head [B*T, cutoff[0] + tails], then each tail's
        [rows, band size]], their targets as from `adapt_target`). Dropout applies to the input (and inside
        the tails), as upstream's."""
        x = F.dropout(input.reshape(-1, input.size(-1)), self.dropout, self.training)
        targets, rows = self.adapt_target(target)
        output = [self.head(x)]
        for tail, band_rows in zip(self.tail, rows):
            output.append(tail(x.index_select(0, band_rows)))
        return output, targets

    # ---- the full distribution -----------------------------------------------------------------------
    def get_log_prob(self, input: torch.Tensor, target: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Log-probabilities (fp32, or fp64 for fp64 inputs) over the whole vocabulary, [B, T, D] -> [B, T, V] (no input dropout, as
        upstream). `target` is accepted for upstream's signature; every row gets its full distribution
        (upstream, given a target, fills only each row's own band)."""
        bsz, length, dim = input.size()
        x = input.reshape(-1, dim)
        head = F.log_softmax(_at_least_fp32(self.head(x)), dim=-1)
        parts = [head[:, : self.cutoff[0]]]
        for i, tail in enumerate(self.tail):
            cluster = head[:, self.cutoff[0] + i].unsqueeze(1)
            parts.append(F.log_softmax(_at_least_fp32(tail(x)), dim=-1) + cluster)
        return torch.cat(parts, dim=-1).view(bsz, length, self.vocab_size)

    def upgrade_state_dict_named(self, state_dict: dict, name: str) -> dict:
        if f"{name}.version" not in state_dict:
            raise ValueError(
                f"{name}: this adaptive softmax predates upstream's version 1 (no {name}.version) "
                "and cannot be loaded, as in upstream fairseq"
            )
        return state_dict

    def tie_to(self, adaptive_inputs) -> None:
        """Point the tied weights at `adaptive_inputs`' Parameters again (moving a meta-device model with
        `to_empty` gives every module a new Parameter)."""
        pairs = []
        if isinstance(self.head, TiedHeadModule):
            word_proj = self.head.word_proj
            pairs.append(
                (
                    word_proj[-1] if isinstance(word_proj, nn.Sequential) else word_proj,
                    adaptive_inputs.weights_for_band(0)[0],
                )
            )
        for i, (proj, _, out_proj) in enumerate(self.tail):
            table, projection = adaptive_inputs.weights_for_band(i + 1)
            pairs += [(out_proj, table), (proj, projection)]
        for module, weight in pairs:
            if isinstance(module, TiedLinear) and module.weight is not weight:
                module.weight = weight
