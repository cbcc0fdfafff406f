"""Transformer building blocks: attention against a naive reference, positions, activations, one layer."""

import math

import pytest
import torch

from fairseq.modules import (
    LearnedPositionalEmbedding,
    CausalSelfAttention,
    SinusoidalPositionalEmbedding,
    TransformerDecoderLayer,
    get_activation_fn,
    make_positions,
    sinusoidal_table,
)
from fairseq.modules.positional_embedding import zero_row_


def naive_causal_attention(attn: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """Softmax attention written out: per-head scores, -inf above the diagonal, weighted values."""
    batch, length, dim = x.shape
    heads, head_dim = attn.num_heads, dim // attn.num_heads
    q = (x @ attn.q_proj.weight.T + attn.q_proj.bias) * head_dim**-0.5
    k = x @ attn.k_proj.weight.T + attn.k_proj.bias
    v = x @ attn.v_proj.weight.T + attn.v_proj.bias
    out = torch.empty_like(x)
    for b in range(batch):
        for h in range(heads):
            cols = slice(h * head_dim, (h + 1) * head_dim)
            scores = q[b, :, cols] @ k[b, :, cols].T
            for i in range(length):
                scores[i, i + 1 :] = float("-inf")
            out[b, :, cols] = torch.softmax(scores, dim=-1) @ v[b, :, cols]
    return out @ attn.out_proj.weight.T + attn.out_proj.bias


def test_sdpa_attention_equals_naive_softmax_attention():
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 4, dropout=0.5).double().eval()  # dropout must be off in eval
    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj):
            proj.bias.normal_()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), naive_causal_attention(attn, x), rtol=1e-10, atol=1e-10)


def test_attention_dropout_applies_in_training_only():
    torch.manual_seed(0)
    attn = CausalSelfAttention(16, 2, dropout=0.5)
    x = torch.randn(1, 6, 16)
    with torch.no_grad():
        attn.train()
        assert not torch.equal(attn(x), attn(x))
        attn.eval()
        assert torch.equal(attn(x), attn(x))


def test_heads_must_divide_embed_dim():
    with pytest.raises(ValueError, match="--decoder-embed-dim 10 is not divisible by --decoder-attention-heads 3"):
        CausalSelfAttention(10, 3)


def test_make_positions_start_after_padding_index_and_skip_pads():
    tokens = torch.tensor([[5, 6, 7, 1, 1], [1, 1, 8, 9, 4]])
    assert make_positions(tokens, 1).tolist() == [[2, 3, 4, 1, 1], [1, 1, 2, 3, 4]]


def test_sinusoidal_table_matches_the_formula():
    dim, pad = 8, 1
    table = sinusoidal_table(20, dim, pad)
    half = dim // 2
    for pos in (0, 2, 5, 19):
        for i in range(half):
            freq = 10000 ** (-i / (half - 1))
            assert table[pos, i].item() == pytest.approx(math.sin(pos * freq), abs=1e-6)
            assert table[pos, half + i].item() == pytest.approx(math.cos(pos * freq), abs=1e-6)
    assert torch.equal(table[pad], torch.zeros(dim))
    assert table[0, half].item() == 1.0  # cos(0) at position 0, which is not the padding row here
    odd = sinusoidal_table(6, 7, None)
    assert odd.shape == (6, 7) and torch.equal(odd[:, 6], torch.zeros(6))


def test_sinusoidal_embedding_looks_up_offset_positions():
    emb = SinusoidalPositionalEmbedding(8, padding_idx=1, init_size=6)
    tokens = torch.tensor([[4, 4, 4, 1]])
    out = emb(tokens)
    table = sinusoidal_table(6, 8, 1)
    assert torch.equal(out[0, :3], table[2:5])
    assert torch.equal(out[0, 3], torch.zeros(8))
    longer = emb(torch.full((1, 9), 4))  # past the precomputed table
    torch.testing.assert_close(longer[0], sinusoidal_table(11, 8, 1)[2:11])
    assert list(emb.state_dict()) == ["_float_tensor"]


def test_learned_positions_have_offset_rows_and_zero_padding_row():
    torch.manual_seed(0)
    emb = LearnedPositionalEmbedding(max_positions=5, embedding_dim=4, padding_idx=1)
    assert emb.weight.shape == (5 + 1 + 1, 4)
    assert torch.equal(emb.weight[1], torch.zeros(4))
    tokens = torch.tensor([[7, 7, 1]])
    out = emb(tokens)
    assert torch.equal(out[0, 0], emb.weight[2]) and torch.equal(out[0, 1], emb.weight[3])
    assert torch.equal(out[0, 2], torch.zeros(4))


def test_activations():
    x = torch.linspace(-3, 3, 13)
    assert torch.equal(get_activation_fn("relu")(x), x.clamp(min=0))
    assert torch.equal(get_activation_fn("linear")(x), x)
    assert torch.equal(get_activation_fn("tanh")(x), torch.tanh(x))
    exact = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    torch.testing.assert_close(get_activation_fn("gelu")(x), exact)
    tanh_approx = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    torch.testing.assert_close(get_activation_fn("gelu_accurate")(x), tanh_approx)
    with pytest.warns(DeprecationWarning):
        assert get_activation_fn("gelu_fast") is get_activation_fn("gelu_accurate")
    with pytest.raises(ValueError, match="--activation-fn 'swishy' is not supported"):
        get_activation_fn("swishy")


@pytest.mark.parametrize("normalize_before", [False, True])
def test_decoder_layer_matches_a_handwritten_block(normalize_before):
    torch.manual_seed(0)
    layer = TransformerDecoderLayer(
        16, 2, 32, dropout=0.0, activation_fn="gelu", normalize_before=normalize_before
    ).eval()
    x = torch.randn(2, 5, 16)
    ln1, ln2 = layer.self_attn_layer_norm, layer.final_layer_norm
    with torch.no_grad():
        if normalize_before:
            h = x + naive_causal_attention(layer.self_attn, ln1(x))
            expected = h + layer.fc2(torch.nn.functional.gelu(layer.fc1(ln2(h))))
        else:
            h = ln1(x + naive_causal_attention(layer.self_attn, x))
            expected = ln2(h + layer.fc2(torch.nn.functional.gelu(layer.fc1(h))))
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_zero_row_hits_exactly_one_row_even_past_bf16_integer_precision():
    weight = torch.ones(70_000, 2, dtype=torch.bfloat16)
    zero_row_(weight, 65_537)
    assert weight.sum(dim=1).eq(0).nonzero().flatten().tolist() == [65_537]
