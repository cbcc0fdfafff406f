"""One q/k/v GEMM for inference (CausalSelfAttention.fuse_qkv_): the fused model computes what the unfused one
does (full forward, incremental steps, the static step), and its state dict keeps upstream's names, order and
values both ways (saved by the fused model, loaded by either)."""

import torch

from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig
from fairseq.modules.causal_attention import fuse_qkv_

VOCAB, PAD = 20, 1
# One GEMM over the concatenated rows against three: each output column is the same dot product, but a BLAS
# may block a wider matrix differently, so a few ulps of fp32 are allowed (this CPU gives equal values).
TOL = 1e-6


def build(seed=0):
    cfg = TransformerLanguageModelConfig(
        decoder_embed_dim=16,
        decoder_ffn_embed_dim=32,
        decoder_layers=2,
        decoder_attention_heads=4,
        max_target_positions=32,
        dropout=0.0,
        decoder_learned_pos=True,
    )
    torch.manual_seed(seed)
    return TransformerLanguageModel.build(cfg, VOCAB, PAD).eval()


def steps(model, x):
    """Logits of x through a prompt forward then incremental steps, and through static steps."""
    state = {}
    out = [model(x[:, :3], incremental_state=state)[0]]
    out += [model(x[:, : t + 1], incremental_state=state)[0] for t in range(3, x.size(1))]
    static = {}
    model.decoder.reserve_incremental_state(static, 32, x.size(0))
    model(x[:, :3], incremental_state=static)
    for t in range(3, x.size(1)):
        out.append(model.decoder.forward_static_step(x[:, t : t + 1], torch.tensor([t]), static))
        model.decoder.set_incremental_length(static, t + 1)
    return torch.cat(out, dim=1)


@torch.no_grad()
def test_the_fused_model_computes_the_unfused_ones_logits():
    model = build()
    x = torch.randint(4, VOCAB, (3, 9))
    want_full, want_steps = model(x)[0], steps(model, x)
    assert fuse_qkv_(model) == 2 and fuse_qkv_(model) == 2  # twice: already fused, nothing changes
    attention = model.decoder.layers[0].self_attn
    assert not hasattr(attention, "q_proj") and attention.qkv_proj.weight.shape == (48, 16)
    torch.testing.assert_close(model(x)[0], want_full, atol=TOL, rtol=TOL)
    torch.testing.assert_close(steps(model, x), want_steps, atol=TOL, rtol=TOL)


def test_the_state_dict_keeps_upstreams_names_both_ways(tmp_path):
    model = build(seed=1)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_qkv_(model)
    saved = model.state_dict()
    assert list(saved) == list(want)  # q_proj, k_proj, v_proj under their names, in their place
    assert all(torch.equal(saved[k], want[k]) for k in want)
    path = tmp_path / "model.pt"
    torch.save(saved, path)
    loaded = torch.load(path, weights_only=True)
    x = torch.randint(4, VOCAB, (2, 7))
    with torch.no_grad():
        expected = model(x)[0]
    for fused in (False, True):  # the fused model's file into an unfused model and into a fused one
        other = build(seed=2)
        if fused:
            fuse_qkv_(other)
        assert not other.load_state_dict(loaded).missing_keys
        with torch.no_grad():
            torch.testing.assert_close(other(x)[0], expected, atol=TOL, rtol=TOL)
        assert all(torch.equal(v, want[k]) for k, v in other.state_dict().items())


def test_projections_of_different_dtypes_stay_unfused():
    model = build()
    attention = model.decoder.layers[0].self_attn
    attention.k_proj.to(torch.float64)
    assert not attention.fuse_qkv_() and attention.qkv_proj is None
    assert fuse_qkv_(model) == 1  # the other layer
