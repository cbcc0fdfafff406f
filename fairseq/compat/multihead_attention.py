"""Upstream fairseq's `MultiheadAttention`, for plug-in models and code written against upstream (the compat
wing: nothing in the core uses it; `fairseq.modules.MultiheadAttention` and fairseq.modules.multihead_attention
resolve here).

    attn = MultiheadAttention(embed_dim, num_heads, kdim=None, vdim=None, dropout=0.0, bias=True,
                              add_bias_kv=False, add_zero_attn=False, self_attention=False,
                              encoder_decoder_attention=False, ...)
    out, weights = attn(query, key, value, key_padding_mask=None, incremental_state=None, need_weights=True,
                        static_kv=False, attn_mask=None, before_softmax=False, need_head_weights=False)

Tensors are time first: query [T, B, C], key / value [S, B, kdim / vdim]; `out` is [T, B, C] and `weights` the
attention probabilities averaged over heads [B, T, S] (per head [H, B, T, S] with `need_head_weights`; None
without `need_weights`). Masks follow torch's MultiheadAttention: `attn_mask` [T, S] (or [B * H, T, S]) is added
to the scores when it is floating point and masks where True / nonzero otherwise; `key_padding_mask` [B, S]
masks the keys where nonzero (padding). `incremental_state` caches keys and values under upstream's names
(`prev_key`, `prev_value` [B, H, S, D], `prev_key_padding_mask`), appended to at each step, or with
`static_kv` (encoder-decoder attention) computed once and reused.

The projections, their names and initialization are this fork's `AttentionProjections`, which its own causal
self-attention (fairseq.modules.causal_attention, the transformer layer's) also uses, so upstream state dicts of
either load. Scores go through `F.scaled_dot_product_attention` unless the probabilities are asked for
(`need_weights`, upstream's default, or `before_softmax`), which writes the softmax out.

`xformers_att_config` is accepted and runs the same scaled-dot-product attention through torch (whose fused
kernels are what xformers provided); `xformers_blocksparse_layout` restricts attention to the layout's nonzero
blocks of `xformers_blocksparse_blocksize` positions, as a mask. Quantization noise (`q_noise` > 0) is refused.
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fairseq.modules.causal_attention import AttentionProjections
from fairseq.modules.fairseq_dropout import FairseqDropout
from fairseq.modules.incremental_decoding_utils import FairseqIncrementalState
from fairseq.modules.quant_noise import quant_noise

_STATE = "attn_state"  # upstream's key of the cached keys and values


def _mask_for_xformers(mask: Tensor, to_dtype: Optional[torch.dtype] = None) -> Tensor:
    """A mask in fairseq's convention (floating point: added to the scores; bool / uint8: nonzero masks) in
    xformers' (floating point: added; bool / uint8: nonzero keeps), in `to_dtype` (default: the mask's own)."""
    to_dtype = mask.dtype if to_dtype is None else to_dtype
    if mask.is_floating_point():
        if to_dtype.is_floating_point:
            return mask.to(to_dtype)
        return (mask != float("-inf")).to(to_dtype)
    masked = mask.to(torch.bool)
    if to_dtype.is_floating_point:
        return torch.zeros(mask.shape, dtype=to_dtype, device=mask.device).masked_fill(masked, float("-inf"))
    return (~masked).to(to_dtype)


class MultiheadAttention(FairseqIncrementalState, AttentionProjections):
    """Multi-headed attention ("Attention Is All You Need") with upstream's constructor and call (module
    docstring)."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        self_attention: bool = False,
        encoder_decoder_attention: bool = False,
        dictionary=None,
        q_noise: float = 0.0,
        qn_block_size: int = 8,
        xformers_att_config: Optional[str] = None,
        xformers_blocksparse_layout: Optional[Tensor] = None,
        xformers_blocksparse_blocksize: int = 16,
    ):
        quant_noise(None, q_noise, qn_block_size)  # refuses q_noise > 0
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, kdim=kdim, vdim=vdim)
        if self_attention and not self.qkv_same_dim:
            raise ValueError(
                f"self-attention needs query, key and value of one width (embed_dim {embed_dim}, "
                f"kdim {self.kdim}, vdim {self.vdim})"
            )
        self.dropout_module = FairseqDropout(dropout, module_name=type(self).__name__)
        self.scaling = self.head_dim**-0.5
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim))
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self.beam_size = 1
        self.onnx_trace = False
        self.skip_embed_dim_check = False
        self.use_xformers = xformers_att_config is not None
        self.blocksparse_layout = xformers_blocksparse_layout
        self.blocksparse_blocksize = xformers_blocksparse_blocksize

    def reset_parameters(self):
        super().reset_parameters()
        for bias in (getattr(self, "bias_k", None), getattr(self, "bias_v", None)):
            if bias is not None:
                nn.init.xavier_normal_(bias)

    def prepare_for_onnx_export_(self):
        self.onnx_trace = True

    def set_beam_size(self, beam_size: int) -> None:
        """Encoder-decoder attention: the batch holds `beam_size` consecutive rows per sentence, which share
        the sentence's keys (computed once per sentence)."""
        self.beam_size = beam_size

    def _set_skip_embed_dim_check(self) -> None:
        self.skip_embed_dim_check = True

    # ------------------------------------------------------------------------------------------------ forward
    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        need_weights = need_weights or need_head_weights
        tgt_len, bsz, embed_dim = query.size()
        if not self.skip_embed_dim_check and embed_dim != self.embed_dim:
            raise ValueError(f"query dim {embed_dim} != {self.embed_dim}")
        q, k, v, key_padding_mask, attn_mask = self._heads(
            query, key, value, key_padding_mask, attn_mask, incremental_state, static_kv
        )
        k, v, key_padding_mask, attn_mask = self._extend_keys(k, v, key_padding_mask, attn_mask, bsz)
        heads, head_dim, src_len = self.num_heads, self.head_dim, k.size(2)
        mask = self._additive_mask(attn_mask, key_padding_mask, bsz, tgt_len, src_len, q.dtype, q.device)
        dropout = self.dropout_module.p if self.training or self.dropout_module.apply_during_inference else 0.0
        weights = None
        if need_weights or before_softmax or type(self).apply_sparse_mask is not MultiheadAttention.apply_sparse_mask:
            scores = torch.matmul(q * self.scaling, k.transpose(-1, -2))
            scores = self.apply_sparse_mask(scores.reshape(bsz * heads, tgt_len, src_len), tgt_len, src_len, bsz)
            scores = scores.view(bsz, heads, tgt_len, src_len)
            if mask is not None:
                scores = scores + mask
            if before_softmax:
                return scores.reshape(bsz * heads, tgt_len, src_len), v.reshape(bsz * heads, src_len, head_dim)
            probs = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
            attn = torch.matmul(F.dropout(probs.type_as(scores), dropout, training=dropout > 0), v)
            if need_weights:
                weights = probs.transpose(1, 0)  # [H, B, T, S]
                if not need_head_weights:
                    weights = weights.mean(dim=0)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        attn = attn.permute(2, 0, 1, 3).reshape(tgt_len, bsz, heads * head_dim)
        return self.out_proj(attn), weights

    def _heads(self, query, key, value, key_padding_mask, attn_mask, incremental_state, static_kv: bool):
        """(q, k, v, key_padding_mask, attn_mask): q [B, H, T, D]; k and v [kv B, H, S, D] with the cached ones in
        front (the cache updated); key_padding_mask [kv B, S] or None."""
        tgt_len, bsz, _ = query.size()
        saved = self._get_input_buffer(incremental_state) if incremental_state is not None else None
        if saved is not None and static_kv and "prev_key" in saved:
            if not self.encoder_decoder_attention or self.self_attention:
                raise ValueError("static_kv reuses cached keys: for encoder_decoder_attention only")
            key = value = None  # computed at the first step
        q, k, v, key_padding_mask = self._project(query, key, value, key_padding_mask, bsz)
        if self.bias_k is not None and k is not None:
            k, v, key_padding_mask, attn_mask = self._add_bias(k, v, key_padding_mask, attn_mask, k.size(1))
        heads, head_dim = self.num_heads, self.head_dim
        q = q.reshape(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)  # [B, H, T, D]
        if k is not None:
            k = k.reshape(k.size(0), -1, heads, head_dim).permute(1, 2, 0, 3)  # [kv B, H, S, D]
            v = v.reshape(v.size(0), -1, heads, head_dim).permute(1, 2, 0, 3)
        if saved is not None:
            k, v, key_padding_mask = self._cache(incremental_state, saved, k, v, key_padding_mask, static_kv)
        if key_padding_mask is not None and key_padding_mask.dim() == 0:
            key_padding_mask = None
        kv_bsz, src_len = k.size(0), k.size(2)
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (kv_bsz, src_len):
            raise ValueError(f"key_padding_mask is {tuple(key_padding_mask.shape)}, expected {(kv_bsz, src_len)}")
        return q, k, v, key_padding_mask, attn_mask

    def _extend_keys(self, k: Tensor, v: Tensor, key_padding_mask, attn_mask, bsz: int):
        """(k, v, key_padding_mask, attn_mask) with the zero key and value of add_zero_attn, and one row per batch
        row (beamable encoder-decoder attention: each sentence's keys serve its beam's rows)."""
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(k.shape[:2] + (1, self.head_dim))], dim=2)
            v = torch.cat([v, v.new_zeros(v.shape[:2] + (1, self.head_dim))], dim=2)
            key_padding_mask, attn_mask = self._pad_masks(key_padding_mask, attn_mask)
        kv_bsz = k.size(0)
        if kv_bsz != bsz:
            repeat = bsz // kv_bsz
            k, v = k.repeat_interleave(repeat, dim=0), v.repeat_interleave(repeat, dim=0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.repeat_interleave(repeat, dim=0)
        return k, v, key_padding_mask, attn_mask

    def _project(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor],
        bsz: int,
    ):
        """(q, k, v, key_padding_mask), time first; k and v None when the cache holds them."""
        q = self.q_proj(query)
        if self.self_attention:
            return q, self.k_proj(query), self.v_proj(query), key_padding_mask
        if self.encoder_decoder_attention:
            if key is None:
                return q, None, None, key_padding_mask
            if self.beam_size > 1 and key.size(1) == bsz:  # every beam row brought its sentence's keys
                key = key.view(key.size(0), -1, self.beam_size, key.size(2))[:, :, 0, :]
                if key_padding_mask is not None:
                    key_padding_mask = key_padding_mask.view(-1, self.beam_size, key_padding_mask.size(1))[:, 0, :]
            return q, self.k_proj(key), self.v_proj(key), key_padding_mask  # values from the keys, as upstream
        if key is None or value is None:
            raise ValueError("MultiheadAttention: pass key and value (or build it with self_attention=True)")
        return q, self.k_proj(key), self.v_proj(value), key_padding_mask

    def _cache(
        self,
        incremental_state,
        saved: dict,
        k: Optional[Tensor],
        v: Optional[Tensor],
        key_padding_mask: Optional[Tensor],
        static_kv: bool,
    ):
        """Keys and values [B, H, S, D] with the cached ones in front (or the cached ones, static_kv), stored."""
        if "prev_key" in saved:
            prev_key, prev_value = saved["prev_key"], saved["prev_value"]
            k = prev_key if static_kv else torch.cat([prev_key, k], dim=2)
            v = prev_value if static_kv else torch.cat([prev_value, v], dim=2)
        key_padding_mask = self._append_prev_key_padding_mask(
            key_padding_mask,
            saved.get("prev_key_padding_mask"),
            batch_size=k.size(0),
            src_len=k.size(2),
            static_kv=static_kv,
        )
        saved["prev_key"], saved["prev_value"], saved["prev_key_padding_mask"] = k, v, key_padding_mask
        self._set_input_buffer(incremental_state, saved)
        return k, v, key_padding_mask

    def _additive_mask(
        self,
        attn_mask: Optional[Tensor],
        key_padding_mask: Optional[Tensor],
        bsz: int,
        tgt_len: int,
        src_len: int,
        dtype: torch.dtype,
        device,
    ) -> Optional[Tensor]:
        """attn_mask, key_padding_mask and the block-sparse layout as one mask added to the scores
        [B or 1, H or 1, T, S]; None without any."""
        mask = None
        if attn_mask is not None:
            if attn_mask.is_floating_point():
                mask = attn_mask.to(dtype)
            else:
                mask = torch.zeros(attn_mask.shape, dtype=dtype, device=device).masked_fill(
                    attn_mask.to(torch.bool), float("-inf")
                )
            mask = (
                mask.view(bsz, self.num_heads, tgt_len, src_len)
                if mask.dim() == 3
                else mask.view(1, 1, tgt_len, src_len)
            )
        if key_padding_mask is not None:
            padding = (
                torch.zeros(key_padding_mask.shape, dtype=dtype, device=device)
                .masked_fill(key_padding_mask.to(torch.bool), float("-inf"))
                .view(bsz, 1, 1, src_len)
            )
            mask = padding if mask is None else mask + padding
        if self.blocksparse_layout is not None:
            blocks = self._blocksparse_mask(tgt_len, src_len, dtype, device)
            mask = blocks if mask is None else mask + blocks
        return mask

    def _blocksparse_mask(self, tgt_len: int, src_len: int, dtype: torch.dtype, device) -> Tensor:
        size = self.blocksparse_blocksize
        layout = self.blocksparse_layout.to(device)
        if layout.size(-2) * size < tgt_len or layout.size(-1) * size < src_len:
            raise ValueError(
                f"xformers_blocksparse_layout {tuple(layout.shape)} of blocks of {size} does not cover "
                f"{tgt_len} queries x {src_len} keys"
            )
        keep = torch.kron(layout.ne(0).to(torch.int32), torch.ones(size, size, dtype=torch.int32, device=device))
        keep = keep[..., :tgt_len, :src_len].to(torch.bool)
        return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))

    # ------------------------------------------------------------------------------- upstream's helpers
    @staticmethod
    def _append_prev_key_padding_mask(
        key_padding_mask: Optional[Tensor],
        prev_key_padding_mask: Optional[Tensor],
        batch_size: int,
        src_len: int,
        static_kv: bool,
    ) -> Optional[Tensor]:
        """The padding mask [B, src_len] of the cached keys followed by the new ones (float, 1 = padding): a
        missing part counts as no padding; with `static_kv` the cached mask as it is."""
        if prev_key_padding_mask is not None and static_kv:
            return prev_key_padding_mask
        if prev_key_padding_mask is not None and key_padding_mask is not None:
            return torch.cat([prev_key_padding_mask.float(), key_padding_mask.float()], dim=1)
        present = prev_key_padding_mask if prev_key_padding_mask is not None else key_padding_mask
        if present is None:
            return None
        missing = src_len - present.size(1)
        if missing <= 0:
            return present.float()
        filler = torch.zeros(batch_size, missing, device=present.device)
        parts = [present.float(), filler] if present is prev_key_padding_mask else [filler, present.float()]
        return torch.cat(parts, dim=1)

    def _pad_masks(self, key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor]):
        """Both masks with one more key column, not masked (for a key appended to every row)."""
        if attn_mask is not None:
            attn_mask = torch.cat([attn_mask, attn_mask.new_zeros(attn_mask.shape[:-1] + (1,))], dim=-1)
        if key_padding_mask is not None:
            key_padding_mask = torch.cat(
                [key_padding_mask, key_padding_mask.new_zeros(key_padding_mask.size(0), 1)], dim=1
            )
        return key_padding_mask, attn_mask

    def _add_bias(
        self, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor], bsz: int
    ):
        """`add_bias_kv`: the learned key and value appended to every row ([S, B, C] in, [S + 1, B, C] out)."""
        k = torch.cat([k, self.bias_k.repeat(1, bsz, 1)])
        v = torch.cat([v, self.bias_v.repeat(1, bsz, 1)])
        key_padding_mask, attn_mask = self._pad_masks(key_padding_mask, attn_mask)
        return k, v, key_padding_mask, attn_mask

    def apply_sparse_mask(self, attn_weights: Tensor, tgt_len: int, src_len: int, bsz: int) -> Tensor:
        """Upstream's hook for subclasses ([B * H, T, S] scores in and out); overriding it computes the scores
        written out."""
        return attn_weights

    def _get_reserve_head_index(self, num_heads_to_keep: int) -> List[Tuple[int, int]]:
        """(start, end) rows of the `num_heads_to_keep` heads with the largest summed |weights| + |biases| of
        q, k and v, largest first."""

        def norm(proj, rows):
            total = proj.weight[rows].abs().sum()
            return (total + (proj.bias[rows].abs().sum() if proj.bias is not None else 0)).item()

        spans = [(h * self.head_dim, (h + 1) * self.head_dim) for h in range(self.num_heads)]
        with torch.no_grad():
            sizes = [sum(norm(p, slice(*span)) for p in (self.q_proj, self.k_proj, self.v_proj)) for span in spans]
        order = sorted(range(self.num_heads), key=lambda h: sizes[h], reverse=True)
        return [spans[h] for h in order[:num_heads_to_keep]]

    def _adaptive_prune_heads(self, reserve_head_index: List[Tuple[int, int]]) -> None:
        """Keep only the heads at `reserve_head_index` (new parameters; the query's width stays, so callers set
        `_set_skip_embed_dim_check()`)."""
        rows = torch.cat([torch.arange(start, end) for start, end in reserve_head_index])
        with torch.no_grad():
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                proj.weight = nn.Parameter(proj.weight[rows].detach().clone())
                if proj.bias is not None:
                    proj.bias = nn.Parameter(proj.bias[rows].detach().clone())
                proj.out_features = rows.numel()
            self.out_proj.weight = nn.Parameter(self.out_proj.weight[:, rows].detach().clone())
            self.out_proj.in_features = rows.numel()
        self.num_heads = len(reserve_head_index)
        self.embed_dim = self.head_dim * self.num_heads

    # ------------------------------------------------------------------------------- incremental state
    def _get_input_buffer(self, incremental_state) -> Dict[str, Optional[Tensor]]:
        result = self.get_incremental_state(incremental_state, _STATE)
        return result if result is not None else {}

    def _set_input_buffer(self, incremental_state, buffer: Dict[str, Optional[Tensor]]):
        return self.set_incremental_state(incremental_state, _STATE, buffer)

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        """Row i of the cache continues row `new_order[i]`; encoder-decoder keys shared by a beam's rows are
        selected per sentence."""
        buffer = self._get_input_buffer(incremental_state)
        for name, value in list(buffer.items()):
            if value is None:
                continue
            if self.encoder_decoder_attention:
                if value.size(0) * self.beam_size == new_order.size(0):
                    return incremental_state  # one entry per sentence: nothing to reorder
                if self.beam_size > 1:
                    buffer[name] = value.index_select(0, new_order.reshape(-1, self.beam_size)[:, 0] // self.beam_size)
                    continue
            buffer[name] = value.index_select(0, new_order)
        return self._set_input_buffer(incremental_state, buffer)
