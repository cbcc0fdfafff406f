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
    shape = shape_of(
        decoder_layers=2,
        decoder_embed_dim=64,
        decoder_ffn_embed_dim=256,
        decoder_attention_heads=4,
        dropout=0.0,
        attention_dropout=0.0,
        tokens_per_sample=16,
    )
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
    shape = shape_of(
        decoder_layers=3,
        decoder_embed_dim=64,
        decoder_ffn_embed_dim=256,
        decoder_attention_heads=4,
        tokens_per_sample=16,
    )
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
    shape = shape_of(
        decoder_layers=32,
        decoder_embed_dim=2560,
        decoder_ffn_embed_dim=10240,
        decoder_attention_heads=32,
        dropout=0.0,
        attention_dropout=0.0,
        tokens_per_sample=2048,
    )
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


@pytest.mark.parametrize(
    "args,message",
    [
        (["--fp8"], "--fp8 needs --bf16"),
        (["--fp16", "--fp8"], "use --fp8 with --bf16, not --fp16"),
        (["--bf16", "--fp8-fsdp-all-gather"], "--fp8-fsdp-all-gather needs --fp8"),
        (["--bf16", "--fp8", "--fp8-recipe", "rowwise", "--fp8-fsdp-all-gather"], "works with --fp8-recipe tensorwise"),
    ],
)
def test_cli_float8_errors_name_the_flag(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        plan_memory.main(["--arch", "transformer_lm_gpt3_small"] + args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------ tensor parallelism x FSDP x float8

# The 2-layer, 64-wide gpt3 shape (4 heads, ffn 256, gelu, no dropout, vocabulary 1000) on 8 GPUs as TP 2 x FSDP 4,
# 2 sequences of 32 tokens (T = 64) per data-parallel rank. One TP rank's layer: q, k, v [32, 64] and their
# biases [32] (column-parallel), out_proj [64, 32] (row-parallel) and its bias [64], fc1 [128, 64] + [128], fc2
# [64, 128] + [64], two norms of 2 x [64].
SMALL = dict(decoder_layers=2, decoder_embed_dim=64, decoder_attention_heads=4, tokens_per_sample=32)


@pytest.fixture(scope="module")
def small_tp():
    from fairseq.models.transformer_lm import preset_config as preset

    shape = mm.model_shape(preset("transformer_lm_gpt3_small", **SMALL), 1000)
    setup = mm.TrainingSetup(
        gpus=8,
        batch_size=2,
        tokens_per_sample=32,
        dtype="bf16",
        tensor_parallel=2,
        float8=True,
        compiled=True,
        float8_all_gather=True,
    )
    return shape, setup


def test_float8_all_gather_buffer_of_a_tensor_parallel_layer_in_exact_bytes(small_tp):
    shape, setup = small_tp
    local = mm.local_shape(shape, 2)
    # Weights sharded over the 4 FSDP ranks (dim 0): q/k/v 3 x 8 x 64, out_proj 16 x 32, fc1 32 x 64, fc2 16 x 128
    # = 6144 float8 elements per rank; biases and norms 3 x 8 + 16 + 32 + 16 + 4 x 16 = 152 in bf16.
    assert mm.gathered_layer_bytes(local, setup) == 4 * (6144 * 1 + 152 * 2) == 25792
    assert mm.gathered_layer_bytes(local, dataclasses.replace(setup, float8_all_gather=False)) == 4 * 6296 * 2
    plan = mm.plan(shape, setup)
    assert plan.snapshot("backward, layer 1").terms["layers_in_flight"] == 2 * 25792  # itself + layer 0 prefetched
    # torchao keeps one fp32 scale per float8 weight (6 per layer) with the float8 all-gather, and nothing else
    assert plan.snapshot("optimizer step").terms["float8_scales"] == 2 * 6 * 4
    assert (
        "float8_scales"
        not in mm.plan(shape, dataclasses.replace(setup, float8_all_gather=False)).snapshot("optimizer step").terms
    )


def test_tensor_parallel_float8_traffic_in_exact_bytes(small_tp):
    from fairseq.planning import communication_model as cm

    shape, setup = small_tp
    traffic = {item.what: item.bytes for item in cm.step_traffic(shape, setup)}
    # FSDP: each layer gathered twice (forward, backward), the root (embedding rows 125 x 64, positions 9 x 64, the
    # final norm 2 x 16 per rank) once, in bf16; ring over 4 ranks moves 3/4
    assert traffic["FSDP all-gather (float8 weights, bf16 others)"] == (2 * 2 * 25792 + 4 * 8608 * 2) * 3 // 4
    # TP per layer and pass: the all-gathers of [64 tokens, 64] in float8, the reduce-scatters in bf16; forward and
    # backward of 2 layers; around them 6 bf16 units and the loss's 3 fp32 all-reduces; ring over 2 moves 1/2
    per_pass = 2 * 64 * 64 * (1 + 2)
    around = 6 * 64 * 64 * 2 + 3 * 64 * 4 * 2
    assert traffic["TP activations (float8 all-gathers, bf16 reduce-scatters)"] == (4 * per_pass + around) // 2
    rowwise = dataclasses.replace(setup, float8_recipe="rowwise", float8_all_gather=False)
    plain = {item.what: item.bytes for item in cm.step_traffic(shape, rowwise)}
    assert plain["TP activations (bf16)"] == (4 * 2 * 64 * 64 * 4 + around) // 2  # the plain styles: bf16 gathers


def test_tensor_parallel_float8_activations_in_exact_bytes(small_tp):
    """Per token (T = 64, d = 64, this rank's ffn 128 and 2 heads): the norms' inputs and q, k, v, the attention
    output split 2 ways (768 / 2); the gathered inputs of q/k/v and fc1, gelu's two ffn-wide tensors and the fp32
    logsumexp whole."""
    shape, setup = small_tp
    local = mm.local_shape(shape, 2)
    bf16 = dataclasses.replace(setup, float8=False, compiled=False, float8_all_gather=False)
    assert mm.layer_activation_bytes(local, bf16) == 64 * (768 // 2 + 2 * 64 * 2 + 2 * 128 * 2 + 4 * 2)
    # eager tensorwise: the gathered inputs in float8; out_proj's float8 input (d / 2) beside SDPA's output; fc2's
    # float8 input in place of gelu's bf16 output
    eager = dataclasses.replace(setup, compiled=False)
    assert mm.layer_activation_bytes(local, eager) == 64 * ((768 + 64) // 2 + 2 * 64 + 128 + 128 * 2 + 4 * 2)
    # compiled: as without tensor parallelism (fc2's input recomputed from fc1's output)
    assert mm.layer_activation_bytes(local, setup) == 64 * (768 // 2 + 2 * 64 + 128 * 2 + 4 * 2)
    # rowwise casts each input twice: what bf16 saves
    rowwise = dataclasses.replace(setup, float8_recipe="rowwise", float8_all_gather=False)
    assert mm.layer_activation_bytes(local, rowwise) == mm.layer_activation_bytes(local, bf16)


def test_the_plan_on_a_one_rank_mesh_is_the_tensor_parallel_code_path(small_tp):
    """FAIRSEQ_TP_MESH_OF_ONE=1 runs the TP styles on one GPU: eager float8 then saves what the styles save."""
    shape, setup = small_tp
    one = dataclasses.replace(setup, gpus=1, tensor_parallel=1, compiled=False)
    styled = dataclasses.replace(one, tp_plan_on_one_rank=True)
    assert mm.layer_activation_bytes(shape, one) == 64 * (768 + 2 * 64 * 2 + 2 * 256 * 2 + 16)  # as bf16
    assert mm.layer_activation_bytes(shape, styled) == 64 * (768 + 64 + 2 * 64 + 256 + 256 * 2 + 16)
