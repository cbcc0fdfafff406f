"""Incremental decoding (KV cache): step-by-step logits equal a full forward; reordering; one allocation; the
training forward unchanged; upstream's base classes and positional rule."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fairseq.modules.incremental_decoding_utils import FairseqIncrementalState, with_incremental_state
from fairseq.models import FairseqDecoder, FairseqIncrementalDecoder
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig
from fairseq.modules import CausalSelfAttention, LearnedPositionalEmbedding, SinusoidalPositionalEmbedding

VOCAB, PAD = 24, 1
# fp32 on the CPU: the cached path multiplies the same numbers in other shapes (one token at a time instead of
# a [T, T] block), so sums are reassociated; differences seen are ~1e-6 on logits of magnitude ~1.
ATOL = RTOL = 2e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread


def build(**overrides):
    options = dict(
        decoder_embed_dim=16,
        decoder_input_dim=16,
        decoder_output_dim=16,
        decoder_ffn_embed_dim=32,
        decoder_layers=2,
        decoder_attention_heads=4,
        max_target_positions=40,
        dropout=0.0,
        activation_fn="gelu",
    )
    options.update(overrides)
    torch.manual_seed(0)
    return TransformerLanguageModel.build(TransformerLanguageModelConfig(**options), VOCAB, PAD).eval()


CONFIGS = {
    "sinusoidal-postnorm": {},
    "learned-prenorm": dict(decoder_learned_pos=True, decoder_normalize_before=True),
    "learned-postnorm": dict(decoder_learned_pos=True),
    "sinusoidal-prenorm-no-final-norm": dict(decoder_normalize_before=True, no_decoder_final_norm=True),
    "project-in-out": dict(decoder_input_dim=12, decoder_output_dim=20, decoder_normalize_before=True),
    "layernorm-embedding-tied": dict(
        layernorm_embedding=True,
        share_decoder_input_output_embed=True,
        decoder_learned_pos=True,
        decoder_normalize_before=True,
    ),
    "no-positions": dict(no_token_positional_embeddings=True),
}


def tokens(batch=3, length=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(PAD + 1, VOCAB, (batch, length), generator=g)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@torch.no_grad()
def test_step_by_step_and_prompt_then_steps_equal_the_full_forward(name):
    model = build(**CONFIGS[name])
    x = tokens()
    full = model(x)[0]
    state = {}
    steps = torch.cat([model(x[:, :t], incremental_state=state)[0] for t in range(1, x.size(1) + 1)], dim=1)
    torch.testing.assert_close(steps, full, atol=ATOL, rtol=RTOL)
    # A prompt in one call, a chunk of several tokens after cached ones (the masked path), then single steps.
    state = {}
    chunks = [model(x[:, :4], incremental_state=state)[0], model(x[:, :7], incremental_state=state)[0]]
    chunks += [model(x[:, :t], incremental_state=state)[0] for t in (8, 9)]
    assert [c.size(1) for c in chunks] == [4, 3, 1, 1]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_decoder_call_and_features_only():
    model = build(decoder_output_dim=20)
    x = tokens()
    state = {}
    features = model.decoder(x[:, :5], incremental_state=state, features_only=True)[0]
    assert features.shape == (3, 5, 20)
    torch.testing.assert_close(features, model.decoder(x[:, :5], features_only=True)[0], atol=ATOL, rtol=RTOL)
    last = model.decoder(x[:, :6], encoder_out=None, incremental_state=state)[0]
    torch.testing.assert_close(last, model(x[:, :6])[0][:, 5:], atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_reorder_equals_decoding_the_reordered_batch():
    model = build(decoder_learned_pos=True, decoder_normalize_before=True)
    x = tokens(batch=4)
    state = {}
    model.reserve_incremental_state(state, max_length=12, max_batch=8)
    model(x[:, :5], incremental_state=state)
    # Rows repeat (beams copied), one is dropped, the batch grows to 5 rows: all within the reservation.
    order = torch.tensor([2, 0, 0, 3, 2])
    model.reorder_incremental_state(state, order)
    reordered = x[order]
    out = model(reordered[:, :7], incremental_state=state)[0]
    torch.testing.assert_close(out, model(reordered[:, :7])[0][:, 5:], atol=ATOL, rtol=RTOL)
    # Shrinking (finished sentences leave the batch), through upstream's entry point.
    order = torch.tensor([4, 1])
    model.decoder.reorder_incremental_state_scripting(state, order)
    reordered = reordered[order]
    out = model(reordered[:, :8], incremental_state=state)[0]
    torch.testing.assert_close(out, model(reordered[:, :8])[0][:, 7:], atol=ATOL, rtol=RTOL)


def cache_entries(state):
    return [entry for entry in state.values() if "key_buffer" in entry]


@torch.no_grad()
def test_the_cache_is_allocated_once_at_the_reserved_size():
    model = build()
    x = tokens(batch=2, length=12)
    state = {}
    model.reserve_incremental_state(state, max_length=12, max_batch=4)
    model(x[:, :3], incremental_state=state)
    entries = cache_entries(state)
    assert len(entries) == 2  # one per layer
    pointers = [(e["key_buffer"].data_ptr(), e["value_buffer"].data_ptr()) for e in entries]
    assert all(e["key_buffer"].shape == (4, 4, 12, 4) for e in entries)  # [rows, heads, length, head dim]
    for t in range(4, 13):
        model(x[:, :t], incremental_state=state)
        if t == 8:
            model.reorder_incremental_state(state, torch.tensor([1, 0, 1]))
            x = x[[1, 0, 1]]
    assert [(e["key_buffer"].data_ptr(), e["value_buffer"].data_ptr()) for e in entries] == pointers
    assert all(e["length"] == 12 for e in entries)


@torch.no_grad()
def test_without_a_reservation_the_cache_grows_by_doubling():
    model = build()
    x = tokens(batch=2, length=9)
    state = {}
    outs = [model(x[:, :t], incremental_state=state)[0] for t in range(1, 10)]
    torch.testing.assert_close(torch.cat(outs, dim=1), model(x)[0], atol=ATOL, rtol=RTOL)
    assert [e["key_buffer"].size(2) for e in cache_entries(state)] == [16, 16]  # 1, 2, 4, 8, 16


def old_layer_forward(layer, x):
    """The decoder layer's forward as it was before incremental decoding existed (same calls, same order)."""
    attn = layer.self_attn
    residual = x
    if layer.normalize_before:
        x = layer.self_attn_layer_norm(x)
    batch, length, channels = x.shape
    q, k, v = (
        proj(x).view(batch, length, attn.num_heads, attn.head_dim).transpose(1, 2)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
    )
    a = F.scaled_dot_product_attention(q, k, v, dropout_p=attn.dropout if attn.training else 0.0, is_causal=True)
    x = attn.out_proj(a.transpose(1, 2).reshape(batch, length, channels))
    x = residual + F.dropout(x, layer.dropout, layer.training)
    if not layer.normalize_before:
        x = layer.self_attn_layer_norm(x)
    residual = x
    if layer.normalize_before:
        x = layer.final_layer_norm(x)
    x = layer.activation_fn(layer.fc1(x))
    x = F.dropout(x, layer.activation_dropout, layer.training)
    x = layer.fc2(x)
    x = residual + F.dropout(x, layer.dropout, layer.training)
    if not layer.normalize_before:
        x = layer.final_layer_norm(x)
    return x


def old_model_forward(model, x):
    dec = model.decoder
    h = dec.embed_scale * dec.embed_tokens(x)
    if dec.project_in_dim is not None:
        h = dec.project_in_dim(h)
    h = h + dec.embed_positions(x).to(h.dtype)
    if dec.layernorm_embedding is not None:
        h = dec.layernorm_embedding(h)
    h = F.dropout(h, dec.dropout, dec.training)
    for layer in dec.layers:
        h = old_layer_forward(layer, h)
    if dec.layer_norm is not None:
        h = dec.layer_norm(h)
    if dec.project_out_dim is not None:
        h = dec.project_out_dim(h)
    return dec.output_projection(h)


@pytest.mark.parametrize("name", ["learned-prenorm", "sinusoidal-postnorm", "project-in-out"])
def test_training_forward_is_bitwise_the_old_one_and_never_touches_the_cache(name, monkeypatch):
    model = build(**dict(CONFIGS[name], dropout=0.1, attention_dropout=0.1, activation_dropout=0.1)).train()
    x = tokens()
    x[0, -2:] = PAD  # right padding, as in training batches

    def no_cache(*args, **kwargs):
        raise AssertionError("the training forward reached the incremental path")

    monkeypatch.setattr(CausalSelfAttention, "_forward_incremental", no_cache)
    monkeypatch.setattr(type(model.decoder), "_layers_incremental", no_cache)
    torch.manual_seed(5)
    new = model(x)[0]
    new.sum().backward()
    torch.manual_seed(5)
    old = old_model_forward(model, x)
    assert torch.equal(new, old)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x)[0], old_model_forward(model, x))


@torch.no_grad()
def test_wrapped_layers_decode_incrementally():
    # Activation checkpointing replaces the layers with wrappers: the state still reaches the attention.
    model = build(decoder_normalize_before=True)
    x = tokens()
    full = model(x)[0]
    for i, layer in enumerate(model.decoder.layers):
        model.decoder.layers[i] = checkpoint_wrapper(layer)
    state = {}
    model.reserve_incremental_state(state, max_length=9, max_batch=3)
    steps = torch.cat(
        [model(x[:, :5], incremental_state=state)[0]]
        + [model(x[:, :t], incremental_state=state)[0] for t in range(6, 10)],
        dim=1,
    )
    torch.testing.assert_close(steps, full, atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_bad_incremental_calls_say_what_to_do():
    model = build(decoder_learned_pos=True, max_target_positions=6)
    x = tokens(length=7)
    state = {}
    model(x[:, :3], incremental_state=state)
    with pytest.raises(ValueError, match="3 are cached already; pass the whole sequence so far"):
        model(x[:, :3], incremental_state=state)
    with pytest.raises(ValueError, match="longer than the 6 learned positions.*--max-target-positions"):
        model(x, incremental_state=state)


def test_positions_follow_upstreams_incremental_rule():
    for emb in (LearnedPositionalEmbedding(10, 8, PAD), SinusoidalPositionalEmbedding(8, PAD, init_size=4)):
        x = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]])
        full = emb(x)
        # Upstream: given the whole prefix and a state, the embedding of the last token's position only.
        last = emb(x, incremental_state={})
        assert last.shape == (2, 1, 8)
        assert torch.equal(last, full[:, -1:])
        assert torch.equal(emb.embed_range(1, 3), full[0, 1:4])
        assert torch.equal(emb(x, positions=torch.tensor([[2, 4]])), full[:1, [0, 2]])
    sinusoidal = SinusoidalPositionalEmbedding(8, PAD, init_size=4)
    past_table = sinusoidal.embed_range(10, 2)  # the table grows and is kept
    assert sinusoidal.table.size(0) >= PAD + 1 + 12
    assert torch.equal(past_table, sinusoidal(torch.full((1, 12), 5))[0, 10:])


def test_incremental_state_keys_are_per_module():
    @with_incremental_state
    class Cache(torch.nn.Module):
        pass

    a, b = Cache(), Cache()
    assert isinstance(a, FairseqIncrementalState)
    state = {}
    a.set_incremental_state(state, "k", {"v": torch.ones(1)})
    b.set_incremental_state(state, "k", {"v": torch.zeros(1)})
    assert len(state) == 2
    assert torch.equal(a.get_incremental_state(state, "k")["v"], torch.ones(1))
    assert a.get_incremental_state(state, "other") is None and a.get_incremental_state(None, "k") is None
    assert a.set_incremental_state(None, "k", {}) is None


class CountingAttention(CausalSelfAttention):
    reorders = 0

    def reorder_incremental_state(self, incremental_state, new_order):
        CountingAttention.reorders += 1
        return super().reorder_incremental_state(incremental_state, new_order)


def test_upstreams_reorder_entry_point_reorders_each_cache_once():
    model = build()
    for layer in model.decoder.layers:
        counting = CountingAttention(16, 4)
        counting.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = counting
    state = {}
    with torch.no_grad():
        model(tokens()[:, :3], incremental_state=state)
    CountingAttention.reorders = 0
    model.decoder.reorder_incremental_state_scripting(state, torch.tensor([2, 1, 0]))
    assert CountingAttention.reorders == 2

    # A plug-in decoder on the base class: its walk over submodules finds the attention once too.
    class PluginDecoder(FairseqIncrementalDecoder):
        def __init__(self):
            super().__init__(dictionary=None)
            self.attn = CountingAttention(16, 4)

    plugin = PluginDecoder()
    with torch.no_grad():
        plugin.attn(torch.randn(3, 2, 16), incremental_state=state)
    CountingAttention.reorders = 0
    plugin.reorder_incremental_state_scripting(state, torch.tensor([0, 0, 1]))
    assert CountingAttention.reorders == 1
    assert isinstance(model.decoder, FairseqIncrementalDecoder) and isinstance(model.decoder, FairseqDecoder)


def test_base_decoder_contract():
    class TinyDecoder(FairseqDecoder):
        def __init__(self):
            super().__init__(dictionary=None)
            self.embed = torch.nn.Embedding(5, 3)
            self.out = torch.nn.Linear(3, 5)

        def extract_features(self, prev_output_tokens, encoder_out=None, **kwargs):
            return self.embed(prev_output_tokens), {"attn": None}

        def output_layer(self, features, **kwargs):
            return self.out(features)

    decoder = TinyDecoder()
    logits, extra = decoder(torch.tensor([[1, 2]]))
    assert logits.shape == (1, 2, 5) and extra == {"attn": None}
    lprobs = decoder.get_normalized_probs((logits, extra), log_probs=True)
    assert lprobs.dtype == torch.float32
    torch.testing.assert_close(lprobs.exp().sum(-1), torch.ones(1, 2))
    torch.testing.assert_close(decoder.get_normalized_probs(logits, log_probs=False), lprobs.exp())
    assert decoder.max_positions() == 1e6 and decoder.upgrade_state_dict_named({"a": 1}, "decoder") == {"a": 1}


# ---- the static one-token step (what CUDA graphs capture) -------------------------------------------------


def static_step(model, x, t, state):
    """The token at index t of each row of x through the static step; then the plain-int lengths say t + 1."""
    logits = model.decoder.forward_static_step(x[:, t : t + 1], torch.tensor([t]), state)
    model.decoder.set_incremental_length(state, t + 1)
    return logits


@pytest.mark.parametrize("name", sorted(CONFIGS))
@torch.no_grad()
def test_the_static_step_gives_the_incremental_steps_logits_across_reorders(name):
    model = build(**CONFIGS[name])
    x = tokens(batch=3, length=14)
    dynamic, static = {}, {}
    model.reserve_incremental_state(static, max_length=20, max_batch=5)  # more slots and rows than used
    torch.testing.assert_close(
        model(x[:, :4], incremental_state=static)[0],
        model(x[:, :4], incremental_state=dynamic)[0],
        atol=ATOL,
        rtol=RTOL,
    )
    for t in range(4, 14):
        if t in (8, 11):  # beams copied (rows repeat), then a sentence dropped: both caches reordered in place
            order = torch.tensor([2, 0, 2]) if t == 8 else torch.tensor([2, 0])
            model.reorder_incremental_state(dynamic, order)
            model.reorder_incremental_state(static, order)
            x = x[order]
        expected = model(x[:, : t + 1], incremental_state=dynamic)[0]
        assert expected.shape == (x.size(0), 1, VOCAB)
        torch.testing.assert_close(static_step(model, x, t, static), expected, atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_the_static_step_decodes_new_text_into_the_same_buffers():
    model = build(decoder_learned_pos=True, decoder_normalize_before=True)
    state = {}
    model.reserve_incremental_state(state, max_length=16, max_batch=4)
    first = tokens(batch=4, length=12, seed=1)
    model(first[:, :3], incremental_state=state)
    entries = cache_entries(state)
    assert all(bool((e["key_buffer"][:, :, 3:] == 0).all()) for e in entries)  # unused slots start zeroed
    for t in range(3, 12):
        static_step(model, first, t, state)
    pointers = [(e["key_buffer"].data_ptr(), e["value_buffer"].data_ptr()) for e in entries]
    # New text, fewer rows: what the first text left in the buffers is masked, then overwritten.
    model.decoder.set_incremental_length(state, 0)
    second = tokens(batch=2, length=10, seed=2)
    steps = [model(second[:, :2], incremental_state=state)[0]] + [
        static_step(model, second, t, state) for t in range(2, 10)
    ]
    torch.testing.assert_close(torch.cat(steps, dim=1), model(second)[0], atol=ATOL, rtol=RTOL)
    assert [(e["key_buffer"].data_ptr(), e["value_buffer"].data_ptr()) for e in entries] == pointers
    assert all(e["key_buffer"].shape == (4, 4, 16, 4) and e["length"] == 10 for e in entries)


@torch.no_grad()
def test_the_static_step_from_a_reserved_empty_cache_and_without_one():
    model = build()
    x = tokens(length=5)
    state = {}
    model.reserve_incremental_state(state, max_length=8, max_batch=3)
    steps = [static_step(model, x, t, state) for t in range(5)]  # the first call allocates the reserved cache
    torch.testing.assert_close(torch.cat(steps, dim=1), model(x)[0], atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="a static decode step needs a cache: call reserve_incremental_state"):
        model.decoder.forward_static_step(x[:, :1], torch.tensor([0]), {})
