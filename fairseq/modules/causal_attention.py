"""Causal multi-head self-attention through `F.scaled_dot_product_attention`: the transformer layer's attention.

Parameter names and initialization follow upstream fairseq's MultiheadAttention (separate q/k/v/out
projections with bias, `AttentionProjections`), so upstream state dicts load unchanged. No mask is materialized:
SDPA's `is_causal=True` selects the fused kernels (flash / memory-efficient) where available. Upstream's general
attention (key/value inputs, masks, attention weights, time-first tensors) is the compat wing's
MultiheadAttention (fairseq.compat.multihead_attention, upstream's fairseq.modules.multihead_attention), on the
same projections.

With an `incremental_state` the module caches keys and values across calls (see `_cache_entry` for the
layout): each call computes only its new tokens and attends over everything cached so far. With a
`StaticStep` as well (one token per row, the static decode step that CUDA graphs capture, see
fairseq.generation.cuda_graph_decoding) the shapes do not depend on how much is cached: the new key/value go to the slot
held in a device tensor and the token attends over the first `window` slots of the cache (its whole capacity
unless the caller bounds it: a window covering the live length keeps the step's reads near what is cached), the
slots after it masked.
"""

import math
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq.kernels.decode_attention import CACHE_BLOCK, decode_attention, gather_blocks
from fairseq.modules.incremental_decoding_utils import FairseqIncrementalState, IncrementalState

_CACHE_KEY = "attn_state"


class StaticStep(NamedTuple):
    """Where the one new token of each row goes in a static decode step (no Python value that changes per
    step, so a CUDA graph can capture it): `slot` [1] (long) is its index in the sequence and its cache slot, or
    `slot` [rows, 1] one per row (rows at different lengths: a decode engine's rows that joined at different
    times); the token attends over the cache's first `window` slots, masked in one of two ways: `mask`
    [1 or rows, 1, 1, window] (the activations' dtype) is 0 for slots 0 .. slot and -inf after (SDPA), or
    `lengths` (integers on the device, [1] or one per row) are the live lengths the decode attention kernel
    reads (fairseq.kernels.decode_attention: only the live keys, no mask). `slot` and `mask` None: a static
    prefill, the first T tokens [B, T] of sequences written to the caches' rows `rows` (a long tensor [B]) at
    slots 0 .. T-1, attending causally among themselves (fairseq.generation.compiled_step's compiled prefill)."""

    slot: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    lengths: Optional[torch.Tensor] = None
    window: int = 0
    rows: Optional[torch.Tensor] = None


def _write_slot(buffer: torch.Tensor, slot: torch.Tensor, new: torch.Tensor) -> None:
    """The whole cache buffer [rows, H, C, D] takes new [B, H, 1, D] in its rows 0 .. B-1 at slot `slot` ([1]: the
    same for every row, or [B, 1]). One index_put on the buffer itself, not on a slice of its rows: a compiled
    step (torch.compile) then writes in place, where a slice's write is copied out and back (the whole cache)."""
    rows = torch.arange(new.size(0), device=new.device)
    buffer.transpose(1, 2).index_put_((rows, slot.view(-1)), new[:, :, 0])


def _write_prefix(buffer: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> None:
    """The whole cache buffer [rows, H, C, D] takes new [B, H, T, D] in its rows `rows` ([B]) at slots 0 .. T-1:
    one index_put on the buffer itself, in place when compiled (see _write_slot)."""
    slots = torch.arange(new.size(2), device=new.device)
    buffer.transpose(1, 2).index_put_((rows.unsqueeze(1), slots), new.transpose(1, 2))


def check_heads(embed_dim: int, num_heads: int, dim_name: str = "embed_dim", heads_name: str = "num_heads") -> None:
    if num_heads <= 0 or embed_dim % num_heads != 0:
        raise ValueError(
            f"{dim_name} {embed_dim} is not divisible by {heads_name} {num_heads}; pick a head count "
            "that divides the embedding dim"
        )


class AttentionProjections(nn.Module):
    """The q/k/v/out projections of multi-head attention under upstream's names (`q_proj`, `k_proj`, `v_proj`,
    `out_proj`; keys and values may come from inputs of other widths, `kdim` / `vdim`) and upstream's
    initialization; `dropout` is the attention probabilities' dropout."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
    ):
        super().__init__()
        check_heads(embed_dim, num_heads)
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.qkv_same_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.reset_parameters()

    def reset_parameters(self):
        # As upstream: q/k/v keep nn.Linear's default bias init, weights get xavier with gain 1/sqrt(2) when keys
        # and values have the query's width (upstream found it converges better); the output projection gets
        # plain xavier and a zero bias.
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            proj.reset_parameters()
        gain = 1 / math.sqrt(2) if self.qkv_same_dim else 1.0
        for proj in (self.k_proj, self.v_proj, self.q_proj):
            nn.init.xavier_uniform_(proj.weight, gain=gain)
        nn.init.xavier_uniform_(self.out_proj.weight)
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)

    def upgrade_state_dict_named(self, state_dict: dict, name: str) -> None:
        """Upstream's hook: a fused `in_proj_weight` / `in_proj_bias` (older checkpoints) becomes q/k/v rows."""
        prefix = f"{name}." if name else ""
        for kind in ("weight", "bias"):
            fused = state_dict.pop(f"{prefix}in_proj_{kind}", None)
            if fused is not None:
                for proj, part in zip(("q_proj", "k_proj", "v_proj"), fused.chunk(3, dim=0)):
                    state_dict[f"{prefix}{proj}.{kind}"] = part.clone()


class CausalSelfAttention(FairseqIncrementalState, AttentionProjections):
    """`attn(x [B, T, C], incremental_state=None, static_step=None) -> [B, T, C]`: every position attends to
    itself and the positions before it."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True):
        check_heads(embed_dim, num_heads, "--decoder-embed-dim", "--decoder-attention-heads")
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias)
        self.qkv_proj: Optional[nn.Linear] = None  # q/k/v as one Linear after fuse_qkv_()

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        # The heads are counted from the projection's width: every head, or under tensor parallelism (q/k/v
        # split by columns over N ranks) this rank's num_heads / N, with nothing set from outside.
        batch, length, width = x.shape
        return x.view(batch, length, width // self.head_dim, self.head_dim).transpose(1, 2)

    def _qkv(self, x: torch.Tensor):
        """Queries, keys and values of x, heads split: one GEMM when fused (`fuse_qkv_`), else three."""
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self._split_heads(q), self._split_heads(k), self._split_heads(v)

    def forward(
        self,
        x: torch.Tensor,
        incremental_state: Optional[IncrementalState] = None,
        static_step: Optional[StaticStep] = None,
    ) -> torch.Tensor:
        """Causal self-attention over x [B, T, C] -> [B, T, C]; with `incremental_state`, x holds the tokens
        that follow the cached ones; with `static_step` too, x [B, 1, C] is the token at `static_step.slot`."""
        if static_step is not None:
            return self._forward_static_step(x, incremental_state, static_step)
        if incremental_state is not None:
            return self._forward_incremental(x, incremental_state)
        batch, length, _ = x.shape
        q, k, v = self._qkv(x)
        attn = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        attn = attn.transpose(1, 2).reshape(batch, length, -1)  # -1: this rank's heads (see _split_heads)
        return self.out_proj(attn)

    # ---- one q/k/v GEMM for inference ----------------------------------------------------------------------
    def fuse_qkv_(self) -> bool:
        """Replace q_proj, k_proj and v_proj by one Linear, `qkv_proj`, of their rows concatenated (one GEMM a
        call instead of three: what decoding wants). State dicts keep upstream's names both ways: `state_dict()`
        splits the fused rows back into q_proj / k_proj / v_proj, `load_state_dict` of those names fills the
        fused Linear. Returns whether the module is fused; one whose projections are not plain nn.Linear of
        plain tensors on one device and dtype (sharded, quantized) stays as it is."""
        if self.qkv_proj is not None:
            return True
        projections = (self.q_proj, self.k_proj, self.v_proj)
        params = [p for proj in projections for p in proj.parameters(recurse=False)]
        if (
            any(type(proj) is not nn.Linear for proj in projections)
            or any(type(p.data) is not torch.Tensor for p in params)
            or len({(p.dtype, p.device) for p in params}) != 1
        ):
            return False
        weight = self.q_proj.weight
        fused = nn.Linear(
            weight.size(1),
            3 * weight.size(0),
            bias=self.q_proj.bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            fused.weight.copy_(torch.cat([proj.weight for proj in projections]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([proj.bias for proj in projections]))
        fused.requires_grad_(weight.requires_grad)
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = fused
        self.register_state_dict_post_hook(_split_qkv_on_save)
        self.register_load_state_dict_pre_hook(_fuse_qkv_on_load)
        return True

    # ---- incremental decoding ---------------------------------------------------------------------------
    def _cache_entry(self, incremental_state: IncrementalState) -> dict:
        """This layer's entry of the incremental state, created empty on first use:

        - "key_buffer", "value_buffer": [rows, heads, capacity, head_dim] tensors (`cached_heads`), allocated
          once (at the reserved size, see `reserve_incremental_state`); batch row b's keys for its first `length`
          tokens are `key_buffer[b, :, :length]`; rows past the current batch and slots past `length` are unused;
        - "length": how many tokens are cached (a plain int, the same for every row; static steps leave it to
          their caller, see `set_incremental_length`);
        - "reserved": (rows, capacity) to allocate on the first call, when someone said.
        Without a reservation the buffers are allocated at the size the first call needs and grow by doubling.
        Buffers start zeroed: a static step reads every slot (masked), and masked garbage could be NaN.
        """
        entry = self.get_incremental_state(incremental_state, _CACHE_KEY)
        if entry is None:
            entry = {"key_buffer": None, "value_buffer": None, "length": 0, "reserved": (0, 0)}
            self.set_incremental_state(incremental_state, _CACHE_KEY, entry)
        return entry

    def reserve_incremental_state(
        self, incremental_state: IncrementalState, max_length: int, max_batch: int = 0
    ) -> None:
        """Say how many tokens (and batch rows) this state will hold, so the cache is allocated once."""
        entry = self._cache_entry(incremental_state)
        entry["reserved"] = (max(entry["reserved"][0], max_batch), max(entry["reserved"][1], max_length))

    def cached_heads(self) -> int:
        """The heads whose keys and values this module caches: every head, or under tensor parallelism (k_proj
        split by output features over N ranks, fairseq.distributed.tensor_parallel_decoding) this rank's
        num_heads / N, counted from the projection's rows as `_split_heads` counts them."""
        weight = getattr(self.k_proj, "weight", None) if self.qkv_proj is None else None
        if weight is None:  # fused or quantized: never split
            return self.num_heads
        local = weight.to_local() if hasattr(weight, "to_local") else weight  # a DTensor: this rank's rows
        return local.size(0) // self.head_dim

    def _ensure_capacity(self, entry: dict, rows: int, length: int, like: torch.Tensor) -> None:
        buffer = entry["key_buffer"]
        have_rows, have_length = (0, 0) if buffer is None else (buffer.size(0), buffer.size(2))
        if rows <= have_rows and length <= have_length:
            return
        reserved_rows, reserved_length = entry["reserved"]
        new_rows = max(rows, have_rows, reserved_rows)
        new_length = max(length, reserved_length, 2 * have_length if length > have_length else have_length)
        filled, old_rows = entry["length"], have_rows
        for name in ("key_buffer", "value_buffer"):
            new = like.new_zeros(new_rows, self.cached_heads(), new_length, self.head_dim)
            if entry[name] is not None and filled:
                new[:old_rows, :, :filled] = entry[name][:, :, :filled]
            entry[name] = new

    def _forward_incremental(self, x: torch.Tensor, incremental_state: IncrementalState) -> torch.Tensor:
        batch, length, _ = x.shape
        entry = self._cache_entry(incremental_state)
        start = entry["length"]
        end = start + length
        q, k, v = self._qkv(x)
        self._ensure_capacity(entry, batch, end, k)
        entry["key_buffer"][:batch, :, start:end] = k
        entry["value_buffer"][:batch, :, start:end] = v
        keys = entry["key_buffer"][:batch, :, :end]
        values = entry["value_buffer"][:batch, :, :end]
        entry["length"] = end
        dropout = self.dropout if self.training else 0.0
        if length == 1 or start == 0:
            # One new token sees every cached one; a first chunk is an ordinary causal square.
            attn = F.scaled_dot_product_attention(q, keys, values, dropout_p=dropout, is_causal=length > 1)
        else:
            # A chunk after cached tokens: new token i (at start + i) sees keys 0 .. start + i.
            mask = torch.ones(length, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout)
        attn = attn.transpose(1, 2).reshape(batch, length, -1)  # -1: this rank's heads (see _split_heads)
        return self.out_proj(attn)

    def static_cache_shape(self, incremental_state: IncrementalState, rows: int, like: torch.Tensor):
        """(rows, slots) of the cache the static steps write: allocated first (at the reserved size, at least
        `rows` rows) when nothing is cached yet. The plain-int length is read only then: a compiled step
        (torch.compile) would guard on it and recompile for every prompt width (static steps take their
        positions from `slot`, a device tensor)."""
        entry = self._cache_entry(incremental_state)
        buffer = entry["key_buffer"]
        if buffer is None or buffer.size(0) < rows:
            self._ensure_capacity(entry, rows, entry["length"], like)
            buffer = entry["key_buffer"]
        if buffer.size(2) == 0:
            raise ValueError(
                "a static decode step needs a cache: call reserve_incremental_state(state, max_length, max_batch) first"
            )
        return buffer.size(0), buffer.size(2)

    def _forward_static_step(
        self, x: torch.Tensor, incremental_state: IncrementalState, step: StaticStep
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        entry = self._cache_entry(incremental_state)
        q, k, v = self._qkv(x)
        dropout = self.dropout if self.training else 0.0
        if step.slot is None:  # a static prefill (see StaticStep): the chunk is all there is
            _write_prefix(entry["key_buffer"], step.rows, k)
            _write_prefix(entry["value_buffer"], step.rows, v)
            attn = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
            return self.out_proj(attn.transpose(1, 2).reshape(batch, length, -1))
        _write_slot(entry["key_buffer"], step.slot, k)
        _write_slot(entry["value_buffer"], step.slot, v)
        keys, values = entry["key_buffer"][:batch], entry["value_buffer"][:batch]
        block_rows = entry.get("block_rows")  # beam search's block table (see set_block_table)
        if block_rows is not None:
            block_rows, keys, values = block_rows[:batch], entry["key_buffer"], entry["value_buffer"]
        if step.lengths is not None:  # the split-KV kernel: reads each row's live keys only
            attn = decode_attention(q, keys, values, step.lengths, block_rows, max_length=step.window)
        else:
            window = step.mask.size(-1)
            if block_rows is not None:  # each row's keys in order, as a cache without a table holds them
                keys, values = gather_blocks(keys, block_rows, window), gather_blocks(values, block_rows, window)
            else:
                keys, values = keys[:, :, :window], values[:, :, :window]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask, dropout_p=dropout)
        attn = attn.transpose(1, 2).reshape(batch, length, -1)
        return self.out_proj(attn)

    # ---- a block table: beam search reorders its rows by index -------------------------------------------
    def set_block_table(self, incremental_state: IncrementalState, block_rows: Optional[torch.Tensor]) -> None:
        """Static steps read row b's key at slot t from cache row `block_rows[b, t // CACHE_BLOCK]` (an int32
        [rows, capacity / CACHE_BLOCK] device tensor, one for every layer; see fairseq.kernels.decode_attention),
        and still write row b's new key in row b; None: each row reads its own row. The caller keeps the table
        (fairseq.generation.step_model.StepModel.reorder_blocks)."""
        self._cache_entry(incremental_state)["block_rows"] = block_rows

    def take_parent_blocks(
        self, incremental_state: IncrementalState, parents: torch.Tensor, slot: torch.Tensor
    ) -> None:
        """Cache row i takes the CACHE_BLOCK slots of row `parents[i]` in the block that holds `slot` (a [1]
        device tensor: the next step's), read first, then written (a row can be a parent and a child): the one
        block a reorder through a block table copies. Static shapes, no host sync."""
        entry = self._cache_entry(incremental_state)
        rows = parents.numel()
        capacity = entry["key_buffer"].size(2)
        first = slot // CACHE_BLOCK * CACHE_BLOCK
        slots = (first + torch.arange(CACHE_BLOCK, device=slot.device)).clamp_(max=capacity - 1).view(1, -1)
        children = torch.arange(rows, device=slot.device).view(-1, 1)
        for name in ("key_buffer", "value_buffer"):
            buffer = entry[name].transpose(1, 2)  # [rows, capacity, H, D]
            buffer.index_put_((children, slots), buffer[parents.view(-1, 1), slots])

    def copy_incremental_rows(
        self, incremental_state: IncrementalState, source_state: IncrementalState, rows: torch.Tensor, length: int
    ) -> None:
        """Cache rows `rows` (a long tensor) take the first `length` slots of `source_state`'s rows 0, 1, ...:
        a prompt prefilled in a state of its own joins a running batch's caches."""
        entry, source = self._cache_entry(incremental_state), self._cache_entry(source_state)
        self._ensure_capacity(entry, int(rows.max()) + 1, length, source["key_buffer"])
        for name in ("key_buffer", "value_buffer"):
            entry[name][rows, :, :length] = source[name][: rows.numel(), :, :length]

    def set_incremental_length(self, incremental_state: IncrementalState, length: int) -> None:
        """Say that `length` tokens are cached: after static steps, or 0 to reuse the buffers for new text."""
        self._cache_entry(incremental_state)["length"] = length

    def reorder_incremental_state(
        self, incremental_state: IncrementalState, new_order: torch.Tensor, window: Optional[int] = None
    ):
        """Row i of the cache continues row `new_order[i]` (beams reordered, finished sentences dropped).

        Done in place in the allocated buffers: only the filled part is copied, or with `window` the first
        `window` slots, whatever the plain-int length says: static steps do not keep it, and a reorder of fixed
        shapes that reads no length (a device decode step, captured in a CUDA graph) copies the slots their
        caller knows to be live (the live length rounded up), not the whole capacity."""
        entry = self.get_incremental_state(incremental_state, _CACHE_KEY)
        if entry is None or entry["key_buffer"] is None:
            return incremental_state
        rows = new_order.numel()
        if window is None:
            filled = entry["length"]
            self._ensure_capacity(entry, rows, filled, entry["key_buffer"])
        else:
            filled = min(window, entry["key_buffer"].size(2))
        for name in ("key_buffer", "value_buffer"):
            buffer = entry[name]
            buffer[:rows, :, :filled] = buffer[:, :, :filled].index_select(0, new_order)
        return incremental_state


_QKV = ("q_proj", "k_proj", "v_proj")


def _split_qkv_on_save(module, state_dict, prefix, local_metadata) -> None:
    """A fused module's state dict under upstream's names, in upstream's order (q, k, v first). The module's
    keys are the last ones of `state_dict` when its hooks run (children are saved before the hooks)."""
    own = [key for key in state_dict if key.startswith(prefix)]
    entries = {key: state_dict.pop(key) for key in own}
    parts = {kind: entries.pop(f"{prefix}qkv_proj.{kind}", None) for kind in ("weight", "bias")}
    for index, name in enumerate(_QKV):
        for kind, fused in parts.items():
            if fused is not None:  # a copy: the three saved tensors share no storage
                state_dict[f"{prefix}{name}.{kind}"] = fused.detach().chunk(3, dim=0)[index].clone()
    state_dict.update(entries)


def _fuse_qkv_on_load(module, state_dict, prefix, *args) -> None:
    """q_proj / k_proj / v_proj entries into a fused module's `qkv_proj` (the whole set, else left to the
    missing-key report)."""
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{name}.{kind}" for name in _QKV]
        if all(key in state_dict for key in keys):
            state_dict[f"{prefix}qkv_proj.{kind}"] = torch.cat([state_dict.pop(key) for key in keys])


def fuse_qkv_(model: nn.Module) -> int:
    """`fuse_qkv_()` on every CausalSelfAttention of `model` (for inference, after it is moved and cast);
    returns how many are fused."""
    return sum(module.fuse_qkv_() for module in model.modules() if isinstance(module, CausalSelfAttention))
