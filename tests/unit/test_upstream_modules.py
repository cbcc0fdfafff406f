"""Upstream's fairseq.modules for plug-in models, used as upstream's code uses them: MultiheadAttention (time-first,
key/value inputs, masks, attention weights, incremental and encoder-decoder caches) against torch's own
multi-head attention (the function upstream's MultiheadAttention calls outside incremental decoding), rotary
positions against the formula, the small modules, and the names left out with their explaining ImportError."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

import fairseq.modules
from fairseq.modules import (
    FairseqDropout,
    Fp32GroupNorm,
    Fp32LayerNorm,
    GradMultiply,
    LayerDropModuleList,
    LayerNorm,
    MultiheadAttention,
    PositionalEmbedding,
    RotaryPositionalEmbedding,
    SamePad,
    TransposeLast,
    cross_entropy,
    gelu,
    gelu_accurate,
)
from fairseq.modules.multihead_attention import _mask_for_xformers
from fairseq.modules.rotary_positional_embedding import apply_rotary_pos_emb, rotate_half

T, S, B, C, H = 5, 7, 3, 16, 4


def torch_mha(attn, query, key, value, **kwargs):
    """torch's multi-head attention with `attn`'s parameters (upstream's MultiheadAttention calls it whenever it
    has no incremental state)."""
    biases = torch.cat((attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias))
    return F.multi_head_attention_forward(
        query,
        key,
        value,
        attn.embed_dim,
        attn.num_heads,
        torch.empty([0]),
        biases,
        attn.bias_k,
        attn.bias_v,
        attn.add_zero_attn,
        0.0,
        attn.out_proj.weight,
        attn.out_proj.bias,
        False,
        use_separate_proj_weight=True,
        q_proj_weight=attn.q_proj.weight,
        k_proj_weight=attn.k_proj.weight,
        v_proj_weight=attn.v_proj.weight,
        **kwargs,
    )


def inputs(kdim=C, vdim=C, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(T, B, C, generator=g, dtype=torch.float64),
        torch.randn(S, B, kdim, generator=g, dtype=torch.float64),
        torch.randn(S, B, vdim, generator=g, dtype=torch.float64),
    )


def masks(kind):
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(T, S, generator=g) > 0.4
    keep[:, 0] = True  # every query keeps a key
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -2:] = True
    if kind == "bool":
        return ~keep, pad
    if kind == "uint8":
        return (~keep).to(torch.uint8), pad.to(torch.uint8)
    return torch.zeros(T, S, dtype=torch.float64).masked_fill(~keep, float("-inf")), pad


@pytest.mark.parametrize("mask_kind", [None, "bool", "uint8", "float"])
@pytest.mark.parametrize("add_bias_kv, add_zero_attn", [(False, False), (True, False), (False, True), (True, True)])
def test_attention_equals_torchs_with_masks_bias_kv_and_zero_attn(mask_kind, add_bias_kv, add_zero_attn):
    torch.manual_seed(0)
    attn = MultiheadAttention(C, H, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn).double().eval()
    query, key, value = inputs()
    attn_mask, padding = masks(mask_kind) if mask_kind else (None, None)
    torch_padding = None if padding is None else padding.to(torch.bool)
    torch_mask = None if attn_mask is None else (attn_mask if attn_mask.is_floating_point() else attn_mask.bool())
    if mask_kind == "float":  # torch wants both masks of one kind
        torch_padding = torch.zeros(B, S, dtype=torch.float64).masked_fill(torch_padding, float("-inf"))
    want, want_weights = torch_mha(attn, query, key, value, key_padding_mask=torch_padding, attn_mask=torch_mask)
    got, weights = attn(query, key, value, key_padding_mask=padding, attn_mask=attn_mask)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(weights, want_weights)  # averaged over heads: [B, T, S (+1)]
    fast, no_weights = attn(query, key, value, key_padding_mask=padding, attn_mask=attn_mask, need_weights=False)
    assert no_weights is None
    torch.testing.assert_close(fast, want)  # through F.scaled_dot_product_attention


def test_keys_and_values_of_other_widths_and_per_head_weights():
    torch.manual_seed(0)
    attn = MultiheadAttention(C, H, kdim=12, vdim=8).double().eval()
    assert attn.k_proj.in_features == 12 and attn.v_proj.in_features == 8
    query, key, value = inputs(12, 8)
    want, want_weights = torch_mha(attn, query, key, value, average_attn_weights=False)
    got, weights = attn(query, key, value, need_head_weights=True)
    torch.testing.assert_close(got, want)
    assert weights.shape == (H, B, T, S)  # upstream's layout of per-head weights
    torch.testing.assert_close(weights.transpose(0, 1), want_weights)
    with pytest.raises(ValueError, match="self-attention needs query, key and value of one width"):
        MultiheadAttention(C, H, kdim=12, self_attention=True)


def test_self_attention_step_by_step_equals_the_causal_forward_and_reorders():
    torch.manual_seed(0)
    attn = MultiheadAttention(C, H, self_attention=True).double().eval()
    x = inputs()[0]
    causal = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    full, _ = attn(x, x, x, attn_mask=causal)
    state, steps = {}, []
    for t in range(T):
        out, _ = attn(x[t : t + 1], x[t : t + 1], x[t : t + 1], incremental_state=state)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps), full)
    buffer = attn._get_input_buffer(state)
    assert buffer["prev_key"].shape == (B, H, T, C // H) and buffer["prev_key_padding_mask"] is None
    order = torch.tensor([2, 0, 1])
    before = buffer["prev_value"].clone()
    attn.reorder_incremental_state(state, order)
    assert torch.equal(attn._get_input_buffer(state)["prev_value"], before[order])


def test_encoder_decoder_attention_computes_keys_once_and_shares_them_with_the_beam():
    torch.manual_seed(0)
    attn = MultiheadAttention(C, H, kdim=12, vdim=12, encoder_decoder_attention=True).double().eval()
    query, encoder_out, _ = inputs(12, 12)
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[0, -3:] = True
    full, _ = attn(query, encoder_out, encoder_out, key_padding_mask=padding, static_kv=True)
    state, steps = {}, []
    for t in range(T):  # the keys are computed at the first step, then read from the cache
        key = encoder_out if t == 0 else None
        out, _ = attn(query[t : t + 1], key, key, key_padding_mask=padding, incremental_state=state, static_kv=True)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps), full)
    beam = 2  # each sentence's rows come `beam` at a time and share its keys
    attn.set_beam_size(beam)
    rows = torch.arange(B).repeat_interleave(beam)
    shared, _ = attn(
        query[:, rows], encoder_out[:, rows], encoder_out[:, rows], key_padding_mask=padding[rows], static_kv=True
    )
    torch.testing.assert_close(shared, full[:, rows])


def test_before_softmax_and_a_sparse_mask_hook():
    torch.manual_seed(0)
    attn = MultiheadAttention(C, H).double().eval()
    query, key, value = inputs()
    scores, v = attn(query, key, value, before_softmax=True)
    assert scores.shape == (B * H, T, S) and v.shape == (B * H, S, C // H)

    class FirstKeyOnly(MultiheadAttention):
        def apply_sparse_mask(self, attn_weights, tgt_len, src_len, bsz):
            return attn_weights.masked_fill(torch.arange(src_len) > 0, float("-inf"))

    sparse = FirstKeyOnly(C, H).double().eval()
    sparse.load_state_dict(attn.state_dict())
    out, weights = sparse(query, key, value, need_weights=False)
    assert weights is None
    only_first = torch.zeros(T, S, dtype=torch.bool)
    only_first[:, 1:] = True
    torch.testing.assert_close(out, attn(query, key, value, attn_mask=only_first)[0])


def test_xformers_config_and_blocksparse_layout():
    torch.manual_seed(0)
    attn = MultiheadAttention(C, H).double().eval()
    query = key = value = torch.randn(8, B, C, dtype=torch.float64)
    xformers = MultiheadAttention(C, H, xformers_att_config='{"name": "scaled_dot_product"}').double().eval()
    xformers.load_state_dict(attn.state_dict())
    torch.testing.assert_close(xformers(query, key, value)[0], attn(query, key, value)[0])
    layout = torch.tensor([[1, 0], [1, 1]], dtype=torch.int32)
    blocks = (
        MultiheadAttention(
            C, H, xformers_att_config="{}", xformers_blocksparse_layout=layout, xformers_blocksparse_blocksize=4
        )
        .double()
        .eval()
    )
    blocks.load_state_dict(attn.state_dict())
    masked = torch.kron(1 - layout, torch.ones(4, 4, dtype=torch.int32)).bool()  # the zero blocks
    torch.testing.assert_close(blocks(query, key, value)[0], attn(query, key, value, attn_mask=masked)[0])


def test_upstreams_helpers():
    # _append_prev_key_padding_mask: cached then new padding, a missing part counted as no padding
    append = MultiheadAttention._append_prev_key_padding_mask
    new, prev = torch.tensor([[1]]).bool(), torch.tensor([[0, 1, 0]]).bool()
    assert append(None, None, batch_size=1, src_len=4, static_kv=False) is None
    assert append(new, None, batch_size=1, src_len=4, static_kv=False).tolist() == [[0, 0, 0, 1]]
    assert append(None, prev, batch_size=1, src_len=4, static_kv=False).tolist() == [[0, 1, 0, 0]]
    assert append(new, prev, batch_size=1, src_len=4, static_kv=False).tolist() == [[0, 1, 0, 1]]
    assert append(None, torch.tensor([[0, 1, 0, 1]]).bool(), 1, 4, False).tolist() == [[0, 1, 0, 1]]
    assert append(new, prev, batch_size=1, src_len=4, static_kv=True) is prev
    # _add_bias / _pad_masks: one more key, not masked
    attn = MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True)
    k, v = torch.rand(6, 3, 8), torch.rand(6, 3, 8)
    padding, mask = torch.rand(3, 6), torch.rand(6, 6)
    k2, v2, padding2, mask2 = attn._add_bias(k, v, padding, mask, 3)
    assert torch.equal(k2[:6], k) and torch.equal(k2[6], attn.bias_k[0].expand(3, 8))
    assert torch.equal(v2[6], attn.bias_v[0].expand(3, 8))
    assert torch.equal(padding2[:, -1], torch.zeros(3)) and torch.equal(mask2[:, -1], torch.zeros(6))
    assert torch.equal(attn._pad_masks(padding, mask)[0], padding2)
    # head pruning: the largest heads stay; queries keep their width (skip the width check)
    attn = MultiheadAttention(24, 6)
    keep = attn._get_reserve_head_index(num_heads_to_keep=4)
    assert len(keep) == 4 and all(end - start == 4 for start, end in keep)
    attn._adaptive_prune_heads(reserve_head_index=keep)
    attn._set_skip_embed_dim_check()
    x = torch.randn(5, 2, 24)
    out, _ = attn(query=x, key=x, value=x)
    assert out.shape == (5, 2, 24) and attn.num_heads == 4 and attn.head_dim == 4
    # _mask_for_xformers: fairseq's convention (nonzero masks) in xformers' (nonzero keeps), additive kept
    additive = torch.tensor([float("-inf"), 0.0])
    assert torch.equal(_mask_for_xformers(additive), additive)
    assert _mask_for_xformers(additive, to_dtype=torch.bool).tolist() == [False, True]
    assert _mask_for_xformers(torch.tensor([1, 0], dtype=torch.uint8)).tolist() == [0, 1]
    assert torch.equal(
        _mask_for_xformers(torch.tensor([False, True]), to_dtype=torch.float), torch.tensor([0.0, float("-inf")])
    )


def test_parameters_are_upstreams_and_fused_checkpoints_upgrade():
    attn = MultiheadAttention(C, H, add_bias_kv=True)
    assert sorted(attn.state_dict()) == sorted(
        ["bias_k", "bias_v"]
        + [f"{p}.{w}" for p in ("q_proj", "k_proj", "v_proj", "out_proj") for w in ("weight", "bias")]
    )
    fused = {"a.in_proj_weight": torch.randn(3 * C, C), "a.in_proj_bias": torch.randn(3 * C)}
    upgraded = dict(fused)
    attn.upgrade_state_dict_named(upgraded, "a")
    assert torch.equal(upgraded["a.k_proj.weight"], fused["a.in_proj_weight"][C : 2 * C])
    assert torch.equal(upgraded["a.v_proj.bias"], fused["a.in_proj_bias"][2 * C :])
    assert "a.in_proj_weight" not in upgraded
    with pytest.raises(ValueError, match="quantization noise"):
        MultiheadAttention(C, H, q_noise=0.1)


def test_dropout_follows_training_and_retain_dropout():
    torch.manual_seed(0)
    attn = MultiheadAttention(C, H, dropout=0.5)
    query = torch.randn(T, B, C)
    attn.train()
    assert not torch.equal(attn(query, query, query)[0], attn(query, query, query)[0])
    attn.eval()
    assert torch.equal(attn(query, query, query)[0], attn(query, query, query)[0])
    attn.dropout_module.make_generation_fast_("attn", retain_dropout=True)
    assert not torch.equal(attn(query, query, query)[0], attn(query, query, query)[0])


def test_rotary_positions():
    dim, length = 8, 6
    rope = RotaryPositionalEmbedding(dim)
    x = torch.randn(length, 2, dim)
    cos, sin = rope(x, length)
    assert cos.shape == (length, 1, 1, dim)
    freqs = [10000 ** (-2 * i / dim) for i in range(dim // 2)]
    for t in range(length):
        for i, f in enumerate(freqs):
            assert cos[t, 0, 0, i].item() == pytest.approx(math.cos(t * f), abs=1e-6)
            assert sin[t, 0, 0, dim // 2 + i].item() == pytest.approx(math.sin(t * f), abs=1e-6)
    assert torch.equal(rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])), torch.tensor([-3.0, -4.0, 1.0, 2.0]))
    q, k = torch.randn(length, 2, 1, dim), torch.randn(length, 2, 1, dim)
    rq, rk = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))  # a rotation
    # the score of a query and key depends on their distance only: shifting both by 2 keeps it
    shifted_q, shifted_k = apply_rotary_pos_emb(q[:4], k[:4], cos, sin, offset=2)
    torch.testing.assert_close((shifted_q[3] * shifted_k[1]).sum(-1), (rq[3] * rk[1]).sum(-1), rtol=1e-5, atol=1e-5)


def test_small_modules():
    assert isinstance(LayerNorm(8), torch.nn.LayerNorm)
    half = torch.randn(2, 8).half()
    assert Fp32LayerNorm(8)(half).dtype == torch.float16
    torch.testing.assert_close(Fp32LayerNorm(8)(half).float(), F.layer_norm(half.float(), (8,)), atol=1e-3, rtol=0)
    assert Fp32GroupNorm(2, 4)(torch.randn(3, 4, 5).half()).dtype == torch.float16
    x = torch.randn(10)
    torch.testing.assert_close(gelu(x), F.gelu(x))
    torch.testing.assert_close(gelu_accurate(x), F.gelu(x, approximate="tanh"))
    w = torch.ones(3, requires_grad=True)
    GradMultiply.apply(w, 0.25).sum().backward()
    assert w.grad.tolist() == [0.25] * 3
    layers = LayerDropModuleList(p=1.0, modules=[torch.nn.Identity(), torch.nn.Identity()])
    assert len(list(layers.train())) == 0 and len(list(layers.eval())) == 2
    assert TransposeLast()(torch.zeros(2, 3, 4)).shape == (2, 4, 3)
    assert SamePad(4)(torch.zeros(1, 2, 9)).shape == (1, 2, 8) and SamePad(3)(torch.zeros(1, 2, 9)).shape[-1] == 9
    logits, target = torch.randn(6, 5), torch.tensor([0, 1, 2, 3, 4, -100])
    torch.testing.assert_close(cross_entropy(logits, target), F.cross_entropy(logits, target))
    dropout = FairseqDropout(0.5, module_name="Layer").eval()
    assert torch.equal(dropout(torch.ones(100)), torch.ones(100))
    dropout.make_generation_fast_("layer", retain_dropout=True, retain_dropout_modules=["Other"])
    assert not dropout.apply_during_inference
    learned = PositionalEmbedding(10, 4, padding_idx=1, learned=True)
    assert learned.weight.shape == (12, 4) and torch.equal(learned.weight[1], torch.zeros(4))
    assert PositionalEmbedding(10, 4, padding_idx=1)(torch.tensor([[5, 6, 1]])).shape == (1, 3, 4)
    from fairseq.modules.quant_noise import quant_noise

    linear = torch.nn.Linear(2, 2)
    assert quant_noise(linear, 0.0, 8) is linear
    with pytest.raises(ValueError, match="quantization noise"):
        quant_noise(linear, 0.1, 8)


def test_upstream_module_paths_import():
    import importlib

    for module, name in [
        ("fairseq.modules.multihead_attention", "MultiheadAttention"),
        ("fairseq.modules.rotary_positional_embedding", "RotaryPositionalEmbedding"),
        ("fairseq.modules.layer_norm", "LayerNorm"),
        ("fairseq.modules.fairseq_dropout", "FairseqDropout"),
        ("fairseq.modules.sinusoidal_positional_embedding", "SinusoidalPositionalEmbedding"),
        ("fairseq.modules.learned_positional_embedding", "LearnedPositionalEmbedding"),
        ("fairseq.modules.positional_embedding", "PositionalEmbedding"),
        ("fairseq.modules.quant_noise", "quant_noise"),
        ("fairseq.modules.gelu", "gelu_accurate"),
    ]:
        assert hasattr(importlib.import_module(module), name)
    assert all(hasattr(fairseq.modules, name) for name in fairseq.modules.__all__)


@pytest.mark.parametrize(
    "name, why",
    [
        ("TransformerEncoderLayer", "no encoder or encoder-decoder architectures"),
        ("ConvTBC", "no convolutional encoder-decoder (translation) models"),
        ("LightweightConv", "no lightweight / dynamic convolution models"),
        ("ConformerEncoderLayer", "no speech or audio models"),
        ("CharacterTokenEmbedder", "refuses --character-embeddings"),
        ("DynamicCRF", "no non-autoregressive models"),
    ],
)
def test_names_left_out_say_why(name, why):
    with pytest.raises(
        ImportError, match=f"upstream's fairseq.modules.{name} is not part of this fairseq fork: .*{re.escape(why)}"
    ):
        exec(f"from fairseq.modules import {name}")
    with pytest.raises(ImportError, match="upstream module fairseq.modules.conv_tbc is not part of this fairseq fork"):
        import fairseq.modules.conv_tbc  # noqa: F401
