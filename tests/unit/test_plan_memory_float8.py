"""The memory planner's float8 terms (--fp8, --compile, --fp8-fsdp-all-gather): exact bytes on a small shape, the
H200 measurement they are fitted to, and the flags' errors."""

import dataclasses

import pytest

from fairseq.planning import memory_model as mm
from fairseq.planning import plan_memory
from fairseq.models.transformer_lm import preset_config

GIB = 1024**3


def shape_of(**overrides):
    cfg = preset_config("transformer_lm_gpt", **overrides)
    return mm.model_shape(cfg, 50272)


def test_compiled_float8_layer_saves_its_matmul_inputs_in_one_byte_and_recomputes_fc2s():
    shape = shape_of(decoder_layers=2, decoder_embed_dim=64, decoder_ffn_embed_dim=256, decoder_attention_heads=4,
                     dropout=0.0, attention_dropout=0.0, tokens_per_sample=16)
    bf16 = mm.TrainingSetup(batch_size=2, tokens_per_sample=16, dtype="bf16")
    compiled_float8 = dataclasses.replace(bf16, float8=True, compiled=True)
    tokens, d, f = 32, 64, 256
    # bf16: norms' inputs 2*2d, q/k/v/attention 4*2d, inputs of q/k/v and fc1 2*2d, gelu in/out 2*2f, lse 4*heads
    assert mm.layer_activation_bytes(shape, bf16) == tokens * (4 * d + 8 * d + 4 * d + 4 * f + 16)
    # float8 + compile: the two inputs at 1 byte, fc2's input recomputed from fc1's output
    assert mm.layer_activation_bytes(shape, compiled_float8) == tokens * (4 * d + 8 * d + 2 * d + 2 * f + 16)
    # eager float8 saves what bf16 saves
    eager = dataclasses.replace(bf16, float8=True)
    assert mm.layer_activation_bytes(shape, eager) == mm.layer_activation_bytes(shape, bf16)


def test_float8_all_gather_halves_the_gathered_weight_matrices_only():
    shape = shape_of(decoder_layers=3, decoder_embed_dim=64, decoder_ffn_embed_dim=256, decoder_attention_heads=4,
                     tokens_per_sample=16)
    setup = mm.TrainingSetup(gpus=2, batch_size=2, tokens_per_sample=16, dtype="bf16", float8=True, compiled=True)
    gathered = dataclasses.replace(setup, float8_all_gather=True)
    matrices = [s for s in shape.layer_param_shapes if len(s) == 2]
    others = [s for s in shape.layer_param_shapes if len(s) != 2]
    full_bf16 = 2 * 2 * mm.sharded_numel(shape.layer_param_shapes, 2)
    full_float8 = 2 * (mm.sharded_numel(matrices, 2) + 2 * mm.sharded_numel(others, 2))
    phase = "backward, layer 1"  # its own parameters + FSDP2's implicit prefetch of layer 0
    assert mm.plan(shape, setup).snapshot(phase).terms["layers_in_flight"] == 2 * full_bf16
    assert mm.plan(shape, gathered).snapshot(phase).terms["layers_in_flight"] == 2 * full_float8
    assert full_float8 < full_bf16 * 0.6  # the matrices dominate: close to half


def test_h200_measurement_32x2560_batch_8():
    """docs/benchmarks_h200.md, one H200: fairseq-train bf16 peaked at 75.4 GiB allocated,
    --fp8 tensorwise --compile at 60.5 GiB. The bf16 plan is within 1%; the float8 plan errs on the safe side by
    at most 5% (it counts 10 of the 11.8 bytes per token and embed dim that the compiled layer saved)."""
    shape = shape_of(decoder_layers=32, decoder_embed_dim=2560, decoder_ffn_embed_dim=10240,
                     decoder_attention_heads=32, dropout=0.0, attention_dropout=0.0, tokens_per_sample=2048)
    bf16 = mm.TrainingSetup(batch_size=8, dtype="bf16")
    bf16_gib = mm.gib(mm.plan(shape, bf16).peak_bytes)
    float8_gib = mm.gib(mm.plan(shape, dataclasses.replace(bf16, float8=True, compiled=True)).peak_bytes)
    assert abs(bf16_gib - 75.4) / 75.4 < 0.01
    assert 60.5 <= float8_gib <= 60.5 * 1.05


def test_cli_spells_the_float8_flags_as_fairseq_train(capsys):
    args = ["--arch", "transformer_lm_gpt3_small", "--bf16", "--fp8", "--compile", "--fp8-fsdp-all-gather"]
    setup = plan_memory.parse(args).setup
    assert (setup.float8, setup.compiled, setup.float8_all_gather) == (True, True, True)
    assert plan_memory.main(args) == 0
    assert "--fp8, --fp8-fsdp-all-gather, --compile" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--fp8"], "--fp8 needs --bf16"),
    (["--fp16", "--fp8"], "use --fp8 with --bf16, not --fp16"),
    (["--bf16", "--fp8-fsdp-all-gather"], "--fp8-fsdp-all-gather needs --fp8"),
    (["--bf16", "--fp8", "--fp8-recipe", "rowwise", "--fp8-fsdp-all-gather"], "works with --fp8-recipe tensorwise"),
])
def test_cli_float8_errors_name_the_flag(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        plan_memory.main(["--arch", "transformer_lm_gpt3_small"] + args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
