"""fconv_lm (upstream's gated convolutional LM): presets and parameter names against upstream's, the forward
against upstream's computation written with torch.conv_tbc (ConvTBC plus LinearizedConvolution's removal of the
future time steps) and torch's weight_norm hook, causality, incremental decoding and generation, the layer-spec
parser, refusals, and the upgrade of upstream state dicts."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq import registry
from fairseq.data.dictionary import Dictionary
from fairseq.distributed.parallelize import apply_activation_checkpointing, materialize
from fairseq.models.fconv_lm import (
    FConvLanguageModel,
    GBW_LAYERS,
    WIKITEXT103_LAYERS,
    check_config,
    parse_decoder_layers,
    preset_config,
    upgrade_state_dict,
)
from fairseq.modules.gated_convolution import GatedCausalConv, WeightNormLinear
from fairseq.generation.sequence_generator import SequenceGenerator

pytestmark = pytest.mark.usefixtures("one_thread")

PAD = 1
# Three layers of 16 (kernels 3, 3, 1), then one of 24 with no residual and one taking the residual from two
# layers back (16 wide: projected to 24), as the GBW preset's bottlenecks do.
SPEC = "[(16, 3)] * 2 + [(16, 1)] + [(24, 2, 0), (24, 1, 2)]"


def tiny(seed=0, vocab=30, **overrides):
    options = dict(decoder_layers=SPEC, decoder_embed_dim=8, dropout=0.0)
    options.update(overrides)
    torch.manual_seed(seed)
    return FConvLanguageModel.build(preset_config("fconv_lm", **options), vocab, PAD).eval()


# ----------------------------------------------------------------------------------- presets and names


def test_presets_are_upstreams():
    base = preset_config("fconv_lm")
    assert (
        base.dropout,
        base.decoder_embed_dim,
        base.decoder_layers,
        base.decoder_attention,
        base.adaptive_softmax_cutoff,
        base.adaptive_softmax_dropout,
    ) == (0.1, 128, "[(1268, 4)] * 13", "False", None, 0.0)
    wiki = preset_config("fconv_lm_dauphin_wikitext103")
    assert (wiki.decoder_embed_dim, wiki.adaptive_softmax_cutoff, wiki.dropout) == (280, "10000,20000,200000", 0.1)
    assert parse_decoder_layers(wiki.decoder_layers) == (
        [(850, 6, 1)] * 3
        + [(850, 1, 1)]
        + [(850, 5, 1)] * 4
        + [(850, 1, 1)]
        + [(850, 4, 1)] * 3
        + [(1024, 4, 1), (2048, 4, 1)]
    )
    gbw = preset_config("fconv_lm_dauphin_gbw")
    assert (gbw.decoder_embed_dim, gbw.adaptive_softmax_cutoff) == (128, "10000,50000,200000")
    blocks = [((128, 512), 3), ((512, 1024), 3), ((1024, 2048), 6), ((1024, 4096), 1)]
    expected = [(512, 5, 1)]
    for (inner, outer), repeat in blocks:
        expected += [(inner, 1, 0), (inner, 5, 0), (outer, 1, 3)] * repeat
    assert parse_decoder_layers(gbw.decoder_layers) == expected
    assert (wiki.decoder_layers, gbw.decoder_layers) == (WIKITEXT103_LAYERS, GBW_LAYERS)
    # the command line wins over the preset
    assert preset_config("fconv_lm_dauphin_wikitext103", decoder_embed_dim=64, dropout=0.2).decoder_embed_dim == 64
    assert registry.arch_model("fconv_lm_dauphin_gbw") is FConvLanguageModel


def upstream_keys(vocab, embed, adaptive=None):
    """Upstream's FConvDecoder state dict for SPEC (nn.utils.weight_norm: Linear weight_g [out, 1]; ConvTBC
    with dim=2: weight_g [1, 1, out], weight_v [kernel, in, out]), written out by hand."""
    keys = {"decoder.version": (1,), "decoder.embed_tokens.weight": (vocab, embed)}

    def linear(name, n_in, n_out):
        keys.update({f"{name}.weight_g": (n_out, 1), f"{name}.weight_v": (n_out, n_in), f"{name}.bias": (n_out,)})

    def conv(i, n_in, n_out, kernel):
        keys.update(
            {
                f"decoder.convolutions.{i}.weight_g": (1, 1, 2 * n_out),
                f"decoder.convolutions.{i}.weight_v": (kernel, n_in, 2 * n_out),
                f"decoder.convolutions.{i}.bias": (2 * n_out,),
            }
        )

    linear("decoder.fc1", embed, 16)
    conv(0, 16, 16, 3)
    conv(1, 16, 16, 3)
    conv(2, 16, 16, 1)
    conv(3, 16, 24, 2)
    conv(4, 24, 24, 1)
    linear("decoder.projections.4", 16, 24)
    if adaptive is None:
        linear("decoder.fc2", 24, embed)
        linear("decoder.fc3", embed, vocab)
    else:  # cutoffs 10,20 over 30 words, factor 4: tails of 24 // 4 = 6 and 24 // 16 = 1
        keys.update(
            {
                "decoder.adaptive_softmax.version": (1,),
                "decoder.adaptive_softmax.head.weight": (12, 24),
                "decoder.adaptive_softmax.tail.0.0.weight": (6, 24),
                "decoder.adaptive_softmax.tail.0.2.weight": (10, 6),
                "decoder.adaptive_softmax.tail.1.0.weight": (1, 24),
                "decoder.adaptive_softmax.tail.1.2.weight": (10, 1),
            }
        )
    return keys


@pytest.mark.parametrize("criterion", ["cross_entropy", "adaptive_loss"])
def test_parameter_names_and_shapes_are_upstreams(criterion):
    model = tiny(adaptive_softmax_cutoff="10,20", criterion=criterion)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    # upstream builds the adaptive softmax only for --criterion adaptive_loss, fc2/fc3 otherwise
    assert got == upstream_keys(30, 8, adaptive="10,20" if criterion == "adaptive_loss" else None)
    assert model.decoder.version.tolist() == [2.0]
    assert model.transformer_layers() is model.decoder.convolutions and model.max_positions() is None


@pytest.mark.filterwarnings("ignore:.*weight_norm.*is deprecated:FutureWarning")
def test_weight_norm_is_torchs_hook():
    """Upstream's layers are nn.Linear / ConvTBC under torch.nn.utils.weight_norm: the same g and v give the
    same weight here."""
    torch.manual_seed(0)
    ref = torch.nn.utils.weight_norm(nn.Linear(5, 7))
    ours = WeightNormLinear(5, 7)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-6)

    holder = nn.Module()
    holder.weight = nn.Parameter(torch.randn(3, 4, 10))  # ConvTBC's [kernel, in, out]
    torch.nn.utils.weight_norm(holder, dim=2)  # sets holder.weight from weight_g and weight_v
    conv = GatedCausalConv(4, 5, 3)
    conv.load_state_dict({"weight_g": holder.weight_g, "weight_v": holder.weight_v, "bias": conv.bias})
    torch.testing.assert_close(conv.weight, holder.weight.detach(), rtol=0, atol=1e-6)
    # initialized as upstream: weight_g is weight_v's norm (the weight starts as weight_v), bias 0
    torch.testing.assert_close(conv.weight_g, conv.weight_v.norm(dim=(0, 1), keepdim=True), rtol=0, atol=1e-6)
    assert conv.bias.abs().sum() == 0


# ----------------------------------------------------------------------------------- the computation


def upstream_forward(model, tokens):
    """Upstream's FConvDecoder forward (eval, no attention) from the state dict: time-major ConvTBC padded by
    kernel - 1 on both sides, the last kernel - 1 steps removed, GLU over channels, residuals * sqrt(0.5)."""
    sd = {k: v.double() for k, v in model.state_dict().items()}

    def weight(prefix, dim):
        g, v = sd[prefix + "weight_g"], sd[prefix + "weight_v"]
        dims = [d for d in range(v.dim()) if d != dim]
        return v * (g / v.norm(dim=dims, keepdim=True))

    def linear(prefix, x):
        return x @ weight(prefix, 0).t() + sd[prefix + "bias"]

    x = linear("decoder.fc1.", sd["decoder.embed_tokens.weight"][tokens]).transpose(0, 1)  # T x B x C
    outputs = [x]
    for i, (_, kernel, residual_from) in enumerate(parse_decoder_layers(SPEC)):
        residual = None
        if residual_from:
            residual = outputs[-residual_from]
            if f"decoder.projections.{i}.bias" in sd:
                residual = linear(f"decoder.projections.{i}.", residual)
        prefix = f"decoder.convolutions.{i}."
        y = torch.conv_tbc(x.contiguous(), weight(prefix, 2), sd[prefix + "bias"], kernel - 1)
        if kernel > 1:
            y = y[: -(kernel - 1)]
        x = F.glu(y, dim=2)
        if residual is not None:
            x = (x + residual) * math.sqrt(0.5)
        outputs.append(x)
    x = x.transpose(0, 1)
    return linear("decoder.fc3.", linear("decoder.fc2.", x))


def test_forward_is_upstreams_computation():
    model = tiny(seed=1)
    tokens = torch.randint(4, 30, (3, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[0].double(), upstream_forward(model, tokens), rtol=0, atol=1e-5)


def test_output_at_t_depends_on_inputs_up_to_t_only():
    model = tiny(seed=2)
    tokens = torch.randint(4, 30, (2, 12))
    with torch.no_grad():
        base = model(tokens)[0]
        for t in (0, 5, 10):
            changed = tokens.clone()
            changed[:, t + 1 :] = torch.randint(4, 30, changed[:, t + 1 :].shape)
            changed[:, t + 1 :] = torch.where(changed[:, t + 1 :] == tokens[:, t + 1 :], 3, changed[:, t + 1 :])
            out = model(changed)[0]
            torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
            assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :])
    # and through the gradient: d out[t] / d embedding[t'] is zero for t' > t, in training mode too
    model.train()
    emb = model.decoder.embed_tokens
    x = emb(tokens).detach().requires_grad_(True)
    emb.forward = lambda _: x
    model(tokens)[0][:, 6].sum().backward()
    assert x.grad[:, 7:].abs().sum() == 0 and x.grad[:, :7].abs().sum() > 0


def test_adaptive_softmax_output_is_its_log_probabilities():
    model = tiny(seed=3, adaptive_softmax_cutoff="10,20", criterion="adaptive_loss")
    tokens = torch.randint(4, 30, (2, 6))
    with torch.no_grad():
        out = model(tokens)[0]
        features = model(tokens, features_only=True)[0]
    assert features.shape == (2, 6, 24) and out.shape == (2, 6, 30)
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(2, 6), rtol=0, atol=1e-5)
    torch.testing.assert_close(model.get_normalized_probs(out, log_probs=True), out, rtol=0, atol=1e-6)
    assert model.flops_per_token(32) is None
    plain = tiny()
    weights = sum(m.weight_v.numel() for m in plain.modules() if hasattr(m, "weight_v"))
    assert plain.flops_per_token(32) == 6.0 * weights


def test_incremental_decoding_equals_the_full_forward():
    model = tiny(seed=4)
    tokens = torch.randint(4, 30, (3, 9))
    with torch.no_grad():
        full = model(tokens)[0]
        state = {}
        model.decoder.reserve_incremental_state(state, 9, 3)
        parts = [model(tokens[:, :4], incremental_state=state)[0]]  # a prompt in one call
        parts += [model(tokens[:, :t], incremental_state=state)[0] for t in range(5, 10)]  # then one at a time
        torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)
        # beams reordered: the cache follows the rows
        order = torch.tensor([2, 0, 0])
        state = {}
        model(tokens[:, :5], incremental_state=state)
        model.decoder.reorder_incremental_state_scripting(state, order)
        step = model(tokens[order, :6], incremental_state=state)[0]
        torch.testing.assert_close(step[:, 0], full[order, 5], rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="6 are cached already"):
            model(tokens[order, :6], incremental_state=state)


def test_greedy_generation_is_the_argmax_of_full_forwards():
    d = Dictionary()
    for i in range(26):
        d.add_symbol(f"w{i}")
    model = tiny(seed=5, vocab=len(d))
    prompt = [d.index("w3"), d.index("w7")]
    src = torch.tensor([[d.eos()] + prompt])
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([3])}}
    hypo = SequenceGenerator([model], d, beam_size=1, max_len_b=6).generate(
        [model], sample, prefix_tokens=torch.tensor([prompt])
    )[0][0]
    seq = [d.eos()] + prompt
    with torch.no_grad():
        for step in range(len(prompt), 7):  # max_len_b 6: step 6 can only be </s>
            lp = torch.log_softmax(model(torch.tensor([seq]))[0][0, -1], -1)
            lp[d.pad()] = -math.inf
            seq.append(d.eos() if step == 6 else int(lp.argmax()))
            if seq[-1] == d.eos():
                break
    assert hypo["tokens"].tolist() == seq[1:] and len(seq) > 4


def test_activation_checkpointing_wraps_the_convolutions_and_keeps_gradients():
    model, wrapped = tiny(seed=6).train(), tiny(seed=6).train()
    apply_activation_checkpointing(wrapped)
    assert set(wrapped.state_dict()) == set(model.state_dict())
    tokens = torch.randint(4, 30, (2, 7))
    for m in (model, wrapped):
        m(tokens)[0].sum().backward()
    for (name, p), q in zip(model.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6, msg=name)


def test_built_on_meta_and_materialized_as_upstream_initializes():
    cfg = preset_config("fconv_lm", decoder_layers=SPEC, decoder_embed_dim=8, dropout=0.2)
    with torch.device("meta"):
        model = FConvLanguageModel.build(cfg, 30, PAD)
    materialize(model, torch.device("cpu"))
    dec = model.decoder
    assert dec.embed_tokens.weight[PAD].abs().sum() == 0 and dec.version.tolist() == [2.0]
    for m in (dec.fc1, dec.fc3, *dec.convolutions):
        dims = (1,) if isinstance(m, WeightNormLinear) else (0, 1)
        torch.testing.assert_close(m.weight_g, m.weight_v.norm(dim=dims, keepdim=True), rtol=0, atol=1e-6)
        assert m.bias.abs().sum() == 0
    # std of weight_v: sqrt(4 (1 - dropout) / (kernel * in)) for a convolution (a loose check on 2,048 draws)
    conv = GatedCausalConv(32, 32, 2, dropout=0.2)
    assert conv.weight_v.std().item() == pytest.approx(math.sqrt(4 * 0.8 / 64), rel=0.1)


# ----------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "spec, message",
    [
        ("__import__('os').system('true')", "expected a list of"),
        ("[(850, 6)] ** 2", "expected a list of"),
        ("[(850, 6)] * 100000", "more than 10000 layers"),
        ("[(850, 6, 2)]", "only 1 outputs precede it"),
        ("[(850,)]", "each layer is (dim, kernel_size)"),
        ("[(0, 3)]", "must be >= 1"),
        ("[]", "non-empty list"),
        ("[(850, 6", "is not a list expression"),
    ],
)
def test_a_bad_layer_spec_is_refused_naming_the_flag(spec, message):
    with pytest.raises(ValueError, match="--decoder-layers") as err:
        check_config(preset_config("fconv_lm", decoder_layers=spec))
    assert message in str(err.value)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(decoder_attention="True"), "--decoder-attention 'True' is not supported"),
        (dict(decoder_attention="[False, True]", decoder_layers="[(8, 2)] * 2"), "is not supported"),
        (dict(decoder_attention="[False]", decoder_layers="[(8, 2)] * 2"), "has 1 entries for 2 layers"),
        (dict(criterion="adaptive_loss"), "--criterion adaptive_loss needs --adaptive-softmax-cutoff"),
        (dict(criterion="adaptive_loss", adaptive_softmax_cutoff="20,10"), "positive and increasing"),
        (dict(fp8=True), "--fp8 is not supported by fconv_lm"),
        (dict(dropout=1.0), "--dropout must be in [0, 1)"),
        (dict(decoder_embed_dim=0), "--decoder-embed-dim must be positive"),
    ],
)
def test_unsupported_options_are_refused(options, message):
    with pytest.raises(ValueError) as err:
        check_config(preset_config("fconv_lm", **options))
    assert message in str(err.value)
    check_config(preset_config("fconv_lm", decoder_attention="[False, False]", decoder_layers="[(8, 2)] * 2"))


def test_unused_upstream_options_warn(caplog):
    check_config(preset_config("fconv_lm_dauphin_wikitext103", decoder_out_embed_dim=512))
    assert "--adaptive-softmax-cutoff 10000,20000,200000 is unused" in caplog.text
    assert "--decoder-out-embed-dim 512 has no effect" in caplog.text


# ----------------------------------------------------------------------------------- upstream state dicts


@pytest.mark.filterwarnings("ignore:.*weight_norm.*is deprecated:FutureWarning")
def test_upgrade_reexpresses_the_first_weight_norm_layout_exactly():
    """fairseq before decoder.version 2 normalized each convolution per kernel tap (torch's weight_norm with
    dim=0: weight_g [kernel, 1, 1]); the weights it stands for load exactly into today's layout."""
    model = tiny(seed=7)
    sd = model.state_dict()
    old = {k: v for k, v in sd.items() if k != "decoder.version"}  # no version buffer yet: read as version 1
    expected = {}
    for i, (_, kernel, _) in enumerate(parse_decoder_layers(SPEC)):
        prefix = f"decoder.convolutions.{i}."
        v = torch.randn_like(sd[prefix + "weight_v"])
        g = torch.rand(kernel, 1, 1) + 0.5
        holder = nn.Module()
        holder.weight = nn.Parameter(v.clone())
        torch.nn.utils.weight_norm(holder, dim=0)
        with torch.no_grad():
            holder.weight_g.copy_(g)
        old[prefix + "weight_g"], old[prefix + "weight_v"] = holder.weight_g.detach(), holder.weight_v.detach()
        old[prefix + "_linearized_weight"] = torch.zeros(3)  # a cache older files held
        expected[i] = holder.weight_v * (holder.weight_g / holder.weight_v.norm(dim=(1, 2), keepdim=True))
    cfg = {"criterion": "cross_entropy", "adaptive_softmax_cutoff": "10,20", "normalization_constant": 0.5}
    upgraded = upgrade_state_dict(old, cfg)
    assert cfg["adaptive_softmax_cutoff"] is None  # the file has fc3: no adaptive softmax
    fresh = tiny(seed=8)
    fresh.load_state_dict(upgraded, strict=True)
    for i, conv in enumerate(fresh.decoder.convolutions):
        torch.testing.assert_close(conv.weight.detach(), expected[i].detach(), rtol=0, atol=1e-6)
    assert fresh.decoder.version.tolist() == [2.0]
    with pytest.raises(ValueError, match=r"sqrt\(0.4\)"):
        upgrade_state_dict(sd, {"normalization_constant": 0.4})


def test_upstreams_encoder_decoder_fconv_stays_absent_and_points_here():
    with pytest.raises(ImportError) as err:
        exec("from fairseq.models.fconv import FConvDecoder", {})
    assert "is not part of this fairseq fork" in str(err.value) and "fairseq.models.fconv_lm" in str(err.value)
    from fairseq.models.fconv_lm import FConvDecoder  # noqa: F401  upstream's class names, here
