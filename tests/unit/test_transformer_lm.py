"""transformer_lm: upstream parameter names and shapes, presets, sizes, causality, init, legacy state dicts."""

import argparse
import json
import math
import os

import pytest
import torch

from fairseq import registry
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig, preset_config
from fairseq.checkpoint.legacy import upgrade_transformer_lm as upgrade_state_dict
from tests.train_fixtures import spawn_ranks

VOCAB = 100
PAD = 1


def layer_shapes(i, d, ffn):
    """Upstream's per-layer names (fairseq TransformerDecoderLayer) with their shapes."""
    p = f"decoder.layers.{i}."
    return {
        p + "self_attn.q_proj.weight": (d, d),
        p + "self_attn.q_proj.bias": (d,),
        p + "self_attn.k_proj.weight": (d, d),
        p + "self_attn.k_proj.bias": (d,),
        p + "self_attn.v_proj.weight": (d, d),
        p + "self_attn.v_proj.bias": (d,),
        p + "self_attn.out_proj.weight": (d, d),
        p + "self_attn.out_proj.bias": (d,),
        p + "self_attn_layer_norm.weight": (d,),
        p + "self_attn_layer_norm.bias": (d,),
        p + "fc1.weight": (ffn, d),
        p + "fc1.bias": (ffn,),
        p + "fc2.weight": (d, ffn),
        p + "fc2.bias": (d,),
        p + "final_layer_norm.weight": (d,),
        p + "final_layer_norm.bias": (d,),
    }


def shapes(model):
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def build(arch, vocab=VOCAB, **overrides):
    torch.manual_seed(0)
    return TransformerLanguageModel.build(preset_config(arch, **overrides), vocab, PAD)


# ----------------------------------------------------------------------------- names and shapes


def test_transformer_lm_base_keys_sinusoidal_postnorm_no_final_norm():
    model = build("transformer_lm", decoder_layers=2)
    expected = {
        "decoder.version": (1,),
        "decoder.embed_tokens.weight": (100, 512),
        "decoder.embed_positions._float_tensor": (1,),
        "decoder.output_projection.weight": (100, 512),
        **layer_shapes(0, 512, 2048),
        **layer_shapes(1, 512, 2048),
    }
    assert shapes(model) == expected
    assert not model.decoder.layers[0].normalize_before
    assert model.decoder.output_projection.weight is not model.decoder.embed_tokens.weight


def test_bare_transformer_lm_keeps_512_input_output_dims_and_adds_projections_as_upstream():
    """Upstream 0.12.2's `--arch transformer_lm --decoder-embed-dim 64` (its bare arch is a no-op: the
    dataclass's 512 stay): the (V, 512) embedding, bias-free project_in_dim (512 -> 64) and project_out_dim
    (64 -> 512), the (V, 512) output matrix; and the notice training logs, naming the flags that drop them."""
    cfg = preset_config(
        "transformer_lm", decoder_layers=1, decoder_embed_dim=64, decoder_ffn_embed_dim=32, decoder_attention_heads=4
    )
    model = TransformerLanguageModel.build(cfg, VOCAB, PAD)
    assert shapes(model) == {
        "decoder.version": (1,),
        "decoder.embed_tokens.weight": (100, 512),
        "decoder.project_in_dim.weight": (64, 512),
        "decoder.embed_positions._float_tensor": (1,),
        "decoder.layers.0.self_attn.k_proj.weight": (64, 64),
        "decoder.layers.0.self_attn.k_proj.bias": (64,),
        "decoder.layers.0.self_attn.v_proj.weight": (64, 64),
        "decoder.layers.0.self_attn.v_proj.bias": (64,),
        "decoder.layers.0.self_attn.q_proj.weight": (64, 64),
        "decoder.layers.0.self_attn.q_proj.bias": (64,),
        "decoder.layers.0.self_attn.out_proj.weight": (64, 64),
        "decoder.layers.0.self_attn.out_proj.bias": (64,),
        "decoder.layers.0.self_attn_layer_norm.weight": (64,),
        "decoder.layers.0.self_attn_layer_norm.bias": (64,),
        "decoder.layers.0.fc1.weight": (32, 64),
        "decoder.layers.0.fc1.bias": (32,),
        "decoder.layers.0.fc2.weight": (64, 32),
        "decoder.layers.0.fc2.bias": (64,),
        "decoder.layers.0.final_layer_norm.weight": (64,),
        "decoder.layers.0.final_layer_norm.bias": (64,),
        "decoder.project_out_dim.weight": (512, 64),
        "decoder.output_projection.weight": (100, 512),
    }
    assert model.decoder.project_in_dim.bias is None and model.decoder.project_out_dim.bias is None
    assert TransformerLanguageModel.config_notice(cfg) == (
        "input/output dims 512 (upstream's default) with embed dim 64: adds project_in/out; pass "
        "--decoder-input-dim 64 --decoder-output-dim 64 to drop them"
    )

    cfg = preset_config(
        "transformer_lm",
        decoder_layers=1,
        decoder_embed_dim=64,
        decoder_ffn_embed_dim=32,
        decoder_attention_heads=4,
        decoder_input_dim=64,
        decoder_output_dim=64,
    )
    keys = shapes(TransformerLanguageModel.build(cfg, VOCAB, PAD))
    assert keys["decoder.embed_tokens.weight"] == (100, 64) and not any("project_" in k for k in keys)
    assert TransformerLanguageModel.config_notice(cfg) == ""
    cfg = preset_config("transformer_lm", decoder_embed_dim=64, decoder_input_dim=64)
    assert (cfg.decoder_input_dim, cfg.decoder_output_dim) == (64, 512)
    assert TransformerLanguageModel.config_notice(cfg) == (
        "output dim 512 (upstream's default) with embed dim 64: adds project_out; pass --decoder-output-dim 64 "
        "to drop it"
    )
    for arch in ("transformer_lm_gpt", "transformer_lm_big"):  # presets: the dims follow, nothing to say
        assert TransformerLanguageModel.config_notice(preset_config(arch, decoder_embed_dim=64)) == ""


def test_gpt_preset_input_and_output_dims_follow_the_embed_dim_as_upstream():
    """Upstream's `--arch transformer_lm_gpt --decoder-embed-dim 256` (base_lm_architecture fills both dims from
    the embed dim): 256-wide embeddings, no projections, pre-norm with the final layer norm."""
    model = build(
        "transformer_lm_gpt",
        decoder_layers=1,
        decoder_embed_dim=256,
        decoder_ffn_embed_dim=32,
        decoder_attention_heads=4,
    )
    assert shapes(model) == {
        "decoder.version": (1,),
        "decoder.embed_tokens.weight": (100, 256),
        "decoder.embed_positions._float_tensor": (1,),
        "decoder.layers.0.self_attn.k_proj.weight": (256, 256),
        "decoder.layers.0.self_attn.k_proj.bias": (256,),
        "decoder.layers.0.self_attn.v_proj.weight": (256, 256),
        "decoder.layers.0.self_attn.v_proj.bias": (256,),
        "decoder.layers.0.self_attn.q_proj.weight": (256, 256),
        "decoder.layers.0.self_attn.q_proj.bias": (256,),
        "decoder.layers.0.self_attn.out_proj.weight": (256, 256),
        "decoder.layers.0.self_attn.out_proj.bias": (256,),
        "decoder.layers.0.self_attn_layer_norm.weight": (256,),
        "decoder.layers.0.self_attn_layer_norm.bias": (256,),
        "decoder.layers.0.fc1.weight": (32, 256),
        "decoder.layers.0.fc1.bias": (32,),
        "decoder.layers.0.fc2.weight": (256, 32),
        "decoder.layers.0.fc2.bias": (256,),
        "decoder.layers.0.final_layer_norm.weight": (256,),
        "decoder.layers.0.final_layer_norm.bias": (256,),
        "decoder.layer_norm.weight": (256,),
        "decoder.layer_norm.bias": (256,),
        "decoder.output_projection.weight": (100, 256),
    }


def test_saved_config_keeps_its_stored_dims():
    """A checkpoint saved while unset dims followed the embed dim (2026-12-04 to -06) stored them: loading uses
    them, not today's default."""
    from fairseq.dataclass.utils import config_from_dict, config_to_dict

    saved = config_to_dict(
        TransformerLanguageModelConfig(decoder_embed_dim=256, decoder_input_dim=256, decoder_output_dim=256)
    )
    cfg = config_from_dict(TransformerLanguageModelConfig, saved, name="transformer_lm")
    assert (cfg.decoder_embed_dim, cfg.decoder_input_dim, cfg.decoder_output_dim) == (256, 256, 256)
    assert not any("project_" in k for k in shapes(TransformerLanguageModel.build(cfg, VOCAB, PAD)))


def test_transformer_lm_big_is_prenorm_with_final_norm_and_derived_dims():
    model = build("transformer_lm_big", decoder_layers=2)
    expected = {
        "decoder.version": (1,),
        "decoder.embed_tokens.weight": (100, 1024),
        "decoder.embed_positions._float_tensor": (1,),
        "decoder.layer_norm.weight": (1024,),
        "decoder.layer_norm.bias": (1024,),
        "decoder.output_projection.weight": (100, 1024),
        **layer_shapes(0, 1024, 4096),
        **layer_shapes(1, 1024, 4096),
    }
    assert shapes(model) == expected
    assert all(layer.normalize_before for layer in model.decoder.layers)


def test_gpt3_small_learned_positions_with_padding_offset_and_tied_output():
    model = build("transformer_lm_gpt3_small", decoder_layers=1, tokens_per_sample=16)
    expected = {
        "decoder.version": (1,),
        "decoder.embed_tokens.weight": (100, 768),
        "decoder.embed_positions.weight": (16 + PAD + 1, 768),
        "decoder.layer_norm.weight": (768,),
        "decoder.layer_norm.bias": (768,),
        # upstream state dicts hold the tied matrix under both names
        "decoder.output_projection.weight": (100, 768),
        **layer_shapes(0, 768, 3072),
    }
    assert shapes(model) == expected
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight
    assert model.max_positions() == 16


def test_gbw_preset_has_no_final_norm_and_layernorm_embedding_adds_its_keys():
    assert "decoder.layer_norm.weight" not in shapes(build("transformer_lm_gbw", decoder_layers=1))
    with_ln = shapes(build("transformer_lm", decoder_layers=1, decoder_normalize_before=True, layernorm_embedding=True))
    assert with_ln["decoder.layer_norm.weight"] == (512,)
    assert with_ln["decoder.layernorm_embedding.weight"] == (512,)


def test_no_token_positional_embeddings_has_no_position_keys():
    keys = shapes(build("transformer_lm", decoder_layers=1, no_token_positional_embeddings=True))
    assert not any("embed_positions" in k for k in keys)


# ----------------------------------------------------------------------------- presets


def test_presets_fill_only_unset_values():
    args = argparse.Namespace(decoder_layers=2, dropout=0.25)
    registry.ARCH_CONFIG_REGISTRY["transformer_lm_gpt3_small"](args)
    assert (args.decoder_layers, args.dropout) == (2, 0.25)
    assert (args.decoder_embed_dim, args.decoder_attention_heads, args.decoder_ffn_embed_dim) == (768, 12, 3072)
    assert (args.decoder_input_dim, args.decoder_output_dim) == (768, 768)
    assert args.decoder_learned_pos and args.share_decoder_input_output_embed and args.decoder_normalize_before
    assert (args.activation_fn, args.attention_dropout) == ("gelu", 0.0)

    args = argparse.Namespace(decoder_embed_dim=256)
    registry.ARCH_CONFIG_REGISTRY["transformer_lm_big"](args)
    assert (args.decoder_input_dim, args.decoder_output_dim, args.decoder_layers) == (256, 256, 12)
    assert (args.dropout, args.attention_dropout, args.activation_fn) == (0.1, 0.0, "relu")


def test_bare_transformer_lm_preset_changes_nothing():
    args = argparse.Namespace(decoder_embed_dim=256)
    registry.ARCH_CONFIG_REGISTRY["transformer_lm"](args)
    assert vars(args) == {"decoder_embed_dim": 256}
    cfg = preset_config("transformer_lm", decoder_embed_dim=256)
    assert (cfg.decoder_input_dim, cfg.decoder_output_dim) == (512, 512)  # the config's defaults, as upstream
    assert preset_config("transformer_lm", decoder_embed_dim=256, decoder_output_dim=64).decoder_input_dim == 512
    assert not cfg.decoder_normalize_before and not cfg.decoder_learned_pos


def test_preset_values_upstream_forces_override_the_given_ones_with_a_warning(caplog):
    with caplog.at_level("WARNING"):
        cfg = preset_config("transformer_lm_gpt3_small", decoder_input_dim=512, decoder_normalize_before=False)
    assert cfg.decoder_input_dim == 768 and cfg.decoder_normalize_before
    assert "--decoder-input-dim 512 is overridden to 768" in caplog.text
    assert "--decoder-normalize-before False is overridden to True" in caplog.text


@pytest.mark.parametrize(
    "arch,layers,dim,heads,ffn",
    [
        ("transformer_lm_gpt", 12, 768, 12, 3072),
        ("transformer_lm_gpt2_small", 24, 1024, 16, 4096),
        ("transformer_lm_gpt2_medium", 36, 1280, 20, 5120),
        ("transformer_lm_gpt2_big", 48, 1600, 25, 6400),
        ("transformer_lm_gpt3_medium", 24, 1024, 16, 4096),
        ("transformer_lm_gpt3_large", 24, 1536, 16, 6144),
        ("transformer_lm_gpt3_xl", 24, 2048, 32, 8192),
        ("transformer_lm_gpt3_2_7", 32, 2560, 32, 10240),
        ("transformer_lm_gpt3_6_7", 32, 4096, 32, 16384),
        ("transformer_lm_gpt3_13", 40, 5120, 40, 20480),
        ("transformer_lm_gpt3_30", 48, 7168, 56, 28672),
        ("transformer_lm_gpt3_66", 64, 9216, 72, 36864),
        ("transformer_lm_gpt3_175", 96, 12288, 96, 49152),
    ],
)
def test_preset_sizes(arch, layers, dim, heads, ffn):
    cfg = preset_config(arch)
    assert (cfg.decoder_layers, cfg.decoder_embed_dim, cfg.decoder_attention_heads, cfg.decoder_ffn_embed_dim) == (
        layers,
        dim,
        heads,
        ffn,
    )
    assert cfg.decoder_normalize_before and cfg._name == arch


def test_parse_args_and_arch_applies_preset_under_the_command_line():
    missing = [
        f"{reg.flag} {name}"
        for reg, name in (
            (registry.TASK_REGISTRY, "language_modeling"),
            (registry.CRITERION_REGISTRY, "cross_entropy"),
            (registry.LR_SCHEDULER_REGISTRY, "fixed"),
        )
        if name not in reg
    ]
    if missing:
        pytest.skip(f"the training parser needs components not registered yet: {', '.join(missing)}")
    from fairseq import options

    args = options.parse_args_and_arch(
        options.get_training_parser(),
        ["data", "--arch", "transformer_lm_gpt3_small", "--decoder-layers", "2", "--tokens-per-sample", "32"],
    )
    cfg = options.convert_namespace_to_config(args).model
    assert (cfg.decoder_layers, cfg.decoder_embed_dim, cfg.decoder_attention_heads) == (2, 768, 12)
    assert cfg.share_decoder_input_output_embed and cfg.decoder_learned_pos and cfg.tokens_per_sample == 32
    model = TransformerLanguageModel.build(cfg, VOCAB, PAD)
    assert len(model.decoder.layers) == 2
    assert model.decoder.embed_positions.weight.shape == (32 + PAD + 1, 768)

    args = options.parse_args_and_arch(
        options.get_training_parser(),
        ["data", "--arch", "transformer_lm", "--decoder-embed-dim", "256", "--decoder-attention-heads", "4"],
    )
    cfg = options.convert_namespace_to_config(args).model
    assert (cfg.decoder_embed_dim, cfg.decoder_input_dim, cfg.decoder_output_dim) == (256, 512, 512)


# ----------------------------------------------------------------------------- sizes on the meta device


def gpt3_param_count(vocab, positions, layers, d):
    per_layer = 4 * (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + 2 * (2 * d)
    embeddings = vocab * d + (positions + PAD + 1) * d  # output projection is the embedding matrix
    return embeddings + layers * per_layer + 2 * d  # + final layer norm


def meta_model(arch, **overrides):
    with torch.device("meta"):
        return TransformerLanguageModel.build(preset_config(arch, **overrides), 50272, PAD)


def test_gpt3_small_param_count_on_meta():
    model = meta_model("transformer_lm_gpt3_small", tokens_per_sample=2048)
    count = sum(p.numel() for p in model.parameters())
    assert count == gpt3_param_count(50272, 2048, 12, 768) == 125_239_296
    assert all(p.is_meta for p in model.parameters())


def test_gpt3_175_param_count_on_meta():
    model = meta_model("transformer_lm_gpt3_175", tokens_per_sample=2048)
    count = sum(p.numel() for p in model.parameters())
    assert count == gpt3_param_count(50272, 2048, 96, 12288) == 174_604_468_224
    assert abs(count - 175e9) / 175e9 < 0.005


@pytest.mark.parametrize(
    "arch,layers,d,nominal", [("transformer_lm_gpt3_30", 48, 7168, 30e9), ("transformer_lm_gpt3_66", 64, 9216, 66e9)]
)
def test_opt_size_presets_param_counts(arch, layers, d, nominal):
    count = sum(p.numel() for p in meta_model(arch, tokens_per_sample=2048).parameters())
    assert count == gpt3_param_count(50272, 2048, layers, d)
    assert abs(count - nominal) / nominal < 0.01


# ----------------------------------------------------------------------------- behaviour


@pytest.mark.parametrize("arch", ["transformer_lm", "transformer_lm_gpt3_small"])
def test_causal_future_tokens_do_not_change_earlier_logits(arch):
    model = build(
        arch,
        decoder_layers=2,
        decoder_embed_dim=64,
        decoder_attention_heads=4,
        decoder_ffn_embed_dim=128,
        tokens_per_sample=16,
    ).eval()
    tokens = torch.randint(4, VOCAB, (2, 10))
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1 - 4) % (VOCAB - 4) + 4
    with torch.no_grad():
        a, b = model(tokens)[0], model(changed)[0]
    assert a.shape == (2, 10, VOCAB)
    assert torch.equal(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_right_padding_does_not_change_real_token_logits():
    model = build(
        "transformer_lm_gpt3_small",
        decoder_layers=2,
        decoder_embed_dim=64,
        decoder_attention_heads=4,
        tokens_per_sample=16,
    ).eval()
    tokens = torch.randint(4, VOCAB, (1, 5))
    padded = torch.cat([tokens, torch.full((1, 3), PAD)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded)[0][:, :5], model(tokens)[0], rtol=0, atol=1e-5)


def test_dropout_only_in_training():
    model = build(
        "transformer_lm",
        decoder_layers=1,
        decoder_embed_dim=64,
        decoder_attention_heads=4,
        decoder_ffn_embed_dim=64,
        decoder_input_dim=64,
        decoder_output_dim=64,
        attention_dropout=0.3,
    )
    tokens = torch.randint(4, VOCAB, (2, 8))
    with torch.no_grad():
        model.eval()
        assert torch.equal(model(tokens)[0], model(tokens)[0])
        model.train()
        assert not torch.equal(model(tokens)[0], model(tokens)[0])


def test_embedding_is_scaled_by_sqrt_embed_dim_plus_positions():
    model = build(
        "transformer_lm",
        decoder_layers=0,
        decoder_embed_dim=16,
        decoder_input_dim=16,
        decoder_output_dim=16,
        decoder_attention_heads=2,
        dropout=0.0,
    )
    tokens = torch.tensor([[5, 6, 7]])
    table = model.decoder.embed_positions.table
    expected = 4.0 * model.decoder.embed_tokens.weight[tokens] + table[torch.tensor([[2, 3, 4]])]
    torch.testing.assert_close(model.decoder.embed(tokens), expected, rtol=0, atol=0)
    unscaled = build(
        "transformer_lm",
        decoder_layers=0,
        decoder_embed_dim=16,
        decoder_input_dim=16,
        decoder_output_dim=16,
        decoder_attention_heads=2,
        dropout=0.0,
        no_scale_embedding=True,
    )
    expected = unscaled.decoder.embed_tokens.weight[tokens] + table[torch.tensor([[2, 3, 4]])]
    torch.testing.assert_close(unscaled.decoder.embed(tokens), expected, rtol=0, atol=0)
    # the scale is sqrt(--decoder-embed-dim), applied before projecting from --decoder-input-dim
    projected = build(
        "transformer_lm",
        decoder_layers=0,
        decoder_embed_dim=16,
        decoder_input_dim=64,
        decoder_output_dim=16,
        decoder_attention_heads=2,
        dropout=0.0,
    )
    dec = projected.decoder
    expected = dec.project_in_dim(4.0 * dec.embed_tokens.weight[tokens]) + table[torch.tensor([[2, 3, 4]])]
    torch.testing.assert_close(dec.embed(tokens), expected, rtol=0, atol=0)


def test_learned_positions_beyond_table_are_a_clear_error():
    model = build(
        "transformer_lm_gpt3_small",
        decoder_layers=1,
        decoder_embed_dim=64,
        decoder_attention_heads=4,
        tokens_per_sample=8,
    )
    with pytest.raises(ValueError, match="longer than the 8 learned positions"):
        model(torch.randint(4, VOCAB, (1, 9)))


def test_sinusoidal_model_runs_past_its_precomputed_table():
    model = build(
        "transformer_lm",
        decoder_layers=1,
        decoder_embed_dim=64,
        decoder_input_dim=64,
        decoder_output_dim=64,
        decoder_attention_heads=4,
        tokens_per_sample=8,
    ).eval()
    assert model.max_positions() == 8
    assert model(torch.randint(4, VOCAB, (1, 12)))[0].shape == (1, 12, VOCAB)


def test_bf16_model_returns_bf16_logits():
    model = build("transformer_lm", decoder_layers=1, decoder_embed_dim=64, decoder_attention_heads=4).to(
        torch.bfloat16
    )
    assert model(torch.randint(4, VOCAB, (1, 6)))[0].dtype == torch.bfloat16


# ----------------------------------------------------------------------------- init and meta materialization


def test_init_follows_upstream():
    model = build(
        "transformer_lm",
        decoder_layers=1,
        decoder_embed_dim=256,
        decoder_attention_heads=4,
        decoder_input_dim=512,
        decoder_output_dim=512,
    )
    dec = model.decoder
    assert torch.equal(dec.embed_tokens.weight[PAD], torch.zeros(512))
    assert abs(dec.embed_tokens.weight.std().item() - 512**-0.5) < 0.1 * 512**-0.5
    assert abs(dec.output_projection.weight.std().item() - 512**-0.5) < 0.1 * 512**-0.5
    attn = dec.layers[0].self_attn
    assert torch.equal(attn.out_proj.bias, torch.zeros(256))
    xavier_bound = math.sqrt(6 / (256 + 256))
    assert attn.q_proj.weight.abs().max() <= xavier_bound / math.sqrt(2)
    assert attn.q_proj.weight.abs().max() > 0.9 * xavier_bound / math.sqrt(2)
    assert attn.out_proj.weight.abs().max() > 0.9 * xavier_bound
    assert dec.project_in_dim.weight.abs().max() <= math.sqrt(6 / (512 + 256))
    assert torch.equal(dec.version, torch.tensor([3.0]))


def test_reset_parameters_is_deterministic_under_a_seed():
    model = build(
        "transformer_lm_gpt3_small",
        decoder_layers=2,
        decoder_embed_dim=64,
        decoder_attention_heads=4,
        tokens_per_sample=16,
    )
    torch.manual_seed(123)
    model.reset_parameters()
    first = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    model.reset_parameters()
    assert all(torch.equal(first[k], v) for k, v in model.state_dict().items())
    torch.manual_seed(124)
    model.reset_parameters()
    assert not torch.equal(first["decoder.layers.0.fc1.weight"], model.state_dict()["decoder.layers.0.fc1.weight"])


@pytest.mark.parametrize("arch", ["transformer_lm", "transformer_lm_gpt3_small"])
def test_meta_build_then_to_empty_and_reset_matches_a_cpu_build(arch):
    overrides = dict(decoder_layers=2, decoder_embed_dim=64, decoder_attention_heads=4, tokens_per_sample=16)
    cpu_model = build(arch, **overrides)
    torch.manual_seed(7)
    cpu_model.reset_parameters()
    with torch.device("meta"):
        meta = TransformerLanguageModel.build(preset_config(arch, **overrides), VOCAB, PAD)
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.reset_parameters()
    expected = cpu_model.state_dict()
    got = meta.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    if arch == "transformer_lm_gpt3_small":
        assert meta.decoder.output_projection.weight is meta.decoder.embed_tokens.weight
    tokens = torch.randint(4, VOCAB, (1, 6))
    torch.testing.assert_close(meta.eval()(tokens), cpu_model.eval()(tokens), rtol=0, atol=0)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(adaptive_input=True), "--adaptive-input needs --adaptive-input-cutoff"),
        (dict(adaptive_softmax_cutoff="20,10"), "--adaptive-softmax-cutoff '20,10': the cutoffs must be positive and"),
        (dict(character_embeddings=True), "--character-embeddings"),
        (dict(decoder_layerdrop=0.1), "--decoder-layerdrop"),
        (dict(decoder_attention_heads=7), "not divisible by --decoder-attention-heads 7"),
        (
            dict(
                share_decoder_input_output_embed=True,
                decoder_output_dim=256,
                decoder_embed_dim=256,
                decoder_input_dim=512,
                decoder_attention_heads=4,
            ),
            "--decoder-input-dim == --decoder-output-dim",
        ),
        (dict(dropout=1.5), "--dropout must be in"),
    ],
)
def test_bad_configs_name_the_flag(overrides, message):
    with pytest.raises(ValueError, match=message):
        TransformerLanguageModel.build(preset_config("transformer_lm", **overrides), VOCAB, PAD)


def test_preset_config_rejects_unknown_arch_and_options():
    with pytest.raises(ValueError, match="unknown architecture 'transformer_lm_nope'"):
        preset_config("transformer_lm_nope")
    with pytest.raises(ValueError, match="unknown transformer_lm option.*decoder_depth"):
        preset_config("transformer_lm", decoder_depth=3)


def test_max_target_positions_falls_back_to_tokens_per_sample():
    cfg = preset_config("transformer_lm_gpt3_small", decoder_layers=1, tokens_per_sample=24)
    TransformerLanguageModel.build(cfg, VOCAB, PAD)
    assert cfg.max_target_positions == 24
    cfg = TransformerLanguageModelConfig(max_target_positions=40, tokens_per_sample=24, decoder_layers=0)
    assert TransformerLanguageModel.build(cfg, VOCAB, PAD).max_positions() == 40


# ----------------------------------------------------------------------------- upstream state dicts


def legacy_variant(state):
    """An older upstream layout of `state`: fused in_proj, embed_out, layer_norms.N, no version."""
    old = {}
    for key, value in state.items():
        if ".self_attn.q_proj." in key:
            prefix, kind = key.split(".self_attn.q_proj.")
            parts = [state[f"{prefix}.self_attn.{n}_proj.{kind}"] for n in ("q", "k", "v")]
            old[f"{prefix}.self_attn.in_proj_{kind}"] = torch.cat(parts)
        elif ".self_attn.k_proj." in key or ".self_attn.v_proj." in key or key == "decoder.version":
            continue
        elif key == "decoder.output_projection.weight":
            old["decoder.embed_out"] = value
        else:
            renamed = key.replace("self_attn_layer_norm", "layer_norms.0")
            old[renamed.replace("final_layer_norm", "layer_norms.2")] = value
    return old


def test_upgrade_state_dict_maps_older_upstream_layouts():
    model = build(
        "transformer_lm_big",
        decoder_layers=2,
        decoder_embed_dim=64,
        decoder_attention_heads=4,
        decoder_ffn_embed_dim=32,
    )
    state = model.state_dict()
    old = legacy_variant(state)
    assert "decoder.layers.0.self_attn.in_proj_weight" in old and "decoder.embed_out" in old
    upgraded = upgrade_state_dict(old)
    assert upgraded.keys() == state.keys()
    assert all(torch.equal(upgraded[k], state[k]) for k in state)
    fresh = build(
        "transformer_lm_big",
        decoder_layers=2,
        decoder_embed_dim=64,
        decoder_attention_heads=4,
        decoder_ffn_embed_dim=32,
    )
    fresh.load_state_dict(upgraded, strict=True)


def test_upgrade_state_dict_current_layout_is_unchanged_and_shared_output_is_filled():
    model = build(
        "transformer_lm_gpt3_small",
        decoder_layers=1,
        decoder_embed_dim=64,
        decoder_attention_heads=4,
        tokens_per_sample=8,
    )
    state = model.state_dict()
    assert upgrade_state_dict(state).keys() == state.keys()
    without_output = {k: v for k, v in state.items() if k != "decoder.output_projection.weight"}
    upgraded = upgrade_state_dict(without_output)
    assert upgraded["decoder.output_projection.weight"] is state["decoder.embed_tokens.weight"]


def test_upgrade_state_dict_old_sinusoidal_table_and_version_without_final_norm():
    model = build(
        "transformer_lm",
        decoder_layers=1,
        decoder_embed_dim=64,
        decoder_input_dim=64,
        decoder_output_dim=64,
        decoder_attention_heads=4,
    )
    state = dict(model.state_dict())
    del state["decoder.embed_positions._float_tensor"]
    state["decoder.embed_positions.weights"] = torch.ones(10, 64)
    state["decoder.version"] = torch.tensor([2.0])
    cfg = {"decoder_normalize_before": True}
    upgraded = upgrade_state_dict(state, cfg)
    assert "decoder.embed_positions.weights" not in upgraded
    assert torch.equal(upgraded["decoder.embed_positions._float_tensor"], torch.zeros(1))
    assert torch.equal(upgraded["decoder.version"], torch.tensor([1.0]))
    assert cfg["no_decoder_final_norm"] is True
    model.load_state_dict(upgraded, strict=True)

    with_norm = build("transformer_lm_big", decoder_layers=1, decoder_embed_dim=64, decoder_attention_heads=4)
    bad = dict(with_norm.state_dict(), **{"decoder.version": torch.tensor([2.0])})
    with pytest.raises(ValueError, match="inconsistent"):
        upgrade_state_dict(bad)


# ----------------------------------------------------------------------------- init of a sharded (FSDP2) model


def _sharded_init(rank, out_dir):
    """One of 2 ranks: the model built on the meta device, sharded by FSDP2, materialized and initialized; what
    its initialization left, saved as out_dir/rank{rank}.json."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # A file rendezvous: no port to race other tests for.
    dist.init_process_group(
        "gloo", init_method="file://" + os.path.join(out_dir, "rendezvous"), rank=rank, world_size=2
    )
    cfg = preset_config(
        "transformer_lm_gpt3_small",
        decoder_layers=1,
        decoder_embed_dim=32,
        decoder_attention_heads=2,
        tokens_per_sample=8,
    )
    with torch.device("meta"):
        model = TransformerLanguageModel.build(cfg, 64, 1)
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model.decoder.layers[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.reset_parameters()
    dec = model.decoder
    record = dict(
        tied=dec.output_projection.weight is dec.embed_tokens.weight,
        token_pad_row=dec.embed_tokens.weight.full_tensor()[1].abs().sum().item(),
        token_other_row=dec.embed_tokens.weight.full_tensor()[2].abs().sum().item(),
        position_pad_row=dec.embed_positions.weight.full_tensor()[1].abs().sum().item(),
    )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_reset_parameters_on_fsdp2_shards_zeroes_padding_rows_and_keeps_tying(tmp_path):
    spawn_ranks(_sharded_init, 2, str(tmp_path))
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["tied"]
        assert record["token_pad_row"] == 0.0 and record["position_pad_row"] == 0.0
        assert record["token_other_row"] > 0.0


# ----------------------------------------------------------------------------- upstream's forward output


def test_forward_returns_upstreams_logits_and_extra():
    """Upstream code does `model(x)[0]` for the logits: that must be every row's logits, not row 0."""
    model = build(
        "transformer_lm",
        decoder_layers=2,
        decoder_embed_dim=16,
        decoder_input_dim=16,
        decoder_output_dim=16,
        decoder_ffn_embed_dim=32,
        decoder_attention_heads=2,
    ).eval()
    tokens = torch.randint(4, VOCAB, (3, 7))
    with torch.no_grad():
        logits, extra = model(tokens)
        assert logits.shape == (3, 7, VOCAB) and model(tokens)[0].shape == (3, 7, VOCAB)
        assert set(extra) == {"attn", "inner_states"} and extra["attn"] == [None]
        features, feature_extra = model(tokens, features_only=True)
        assert features.shape == (3, 7, 16) and set(feature_extra) == {"attn", "inner_states"}
        torch.testing.assert_close(model.decoder.output_layer(features), logits, rtol=0, atol=0)
        # the last layer's output before the final norm (post-norm transformer_lm: it is the features)
        (last,) = extra["inner_states"]
        torch.testing.assert_close(last, features, rtol=0, atol=0)
        _, every = model(tokens, return_all_hiddens=True)
        hidden = every["inner_states"]
        assert len(hidden) == 3 and all(h.shape == (3, 7, 16) for h in hidden)  # embeddings + 2 layers
        torch.testing.assert_close(hidden[0], model.decoder.embed(tokens), rtol=0, atol=0)
        torch.testing.assert_close(hidden[-1], last, rtol=0, atol=0)
        assert model.decoder(tokens)[0].shape == (3, 7, VOCAB)  # the decoder's own forward too
