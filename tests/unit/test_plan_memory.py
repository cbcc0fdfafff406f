"""python -m fairseq.planning.plan_memory and fairseq.planning.memory_model: exact parameter counts from the real model on the
meta device, the per-GPU byte arithmetic on a hand-computed case, monotonicity, the searches, the CLI."""

import dataclasses
import itertools
import os
import subprocess
import sys
import time

import pytest
import torch

from fairseq.planning import memory_model as mm
from fairseq import registry
from fairseq.planning import plan_memory
from fairseq.planning.request import GPU_MEMORY_GIB
from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT3_175_PARAMS = 174_604_468_224
UNBUILDABLE = {"transformer_lm_wiki103", "transformer_lm_baevski_wiki103"}  # adaptive input/softmax


def transformer_lm_archs():
    return [a for a in registry.architectures() if registry.arch_model(a) is TransformerLanguageModel]


def meta_param_count(arch, vocab=50272, **overrides):
    with torch.device("meta"):
        model = TransformerLanguageModel.build(preset_config(arch, **overrides), vocab, 1)
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------ parameter counts


def test_every_transformer_lm_preset_counts_what_the_real_model_builds():
    archs = transformer_lm_archs()
    assert len(archs) >= 20 and "transformer_lm_gpt3_175" in archs
    for arch in archs:
        if arch in UNBUILDABLE:
            continue
        request = plan_memory.parse(["--arch", arch])
        shape = request.shape
        assert shape.total_params == meta_param_count(arch, tokens_per_sample=2048), arch
        assert shape.total_params == shape.num_layers * shape.layer_params + shape.root_params, arch


def test_wiki103_presets_are_refused_with_the_flag_named(capsys):
    for arch in sorted(UNBUILDABLE):
        with pytest.raises(SystemExit) as exit_info:
            plan_memory.main(["--arch", arch])
        assert exit_info.value.code == 2
        assert "--adaptive-softmax-cutoff" in capsys.readouterr().err


def test_gpt3_175_parameters_line_is_exact(capsys):
    assert (
        plan_memory.main(
            [
                "--arch",
                "transformer_lm_gpt3_175",
                "--gpus",
                "1024",
                "--gpu",
                "a100-80gb",
                "--bf16",
                "--checkpoint-activations",
                "--batch-size",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"parameters: {GPT3_175_PARAMS}\n" in out
    assert abs(GPT3_175_PARAMS - 175e9) / 175e9 < 0.005


def test_model_flags_override_the_preset_and_with_layers_matches_a_real_build():
    request = plan_memory.parse(
        [
            "--arch",
            "transformer_lm_gpt3_175",
            "--decoder-layers",
            "3",
            "--tokens-per-sample",
            "1024",
            "--vocab-size",
            "1000",
        ]
    )
    assert request.shape.total_params == meta_param_count(
        "transformer_lm_gpt3_175", vocab=1000, decoder_layers=3, tokens_per_sample=1024
    )
    deeper = request.shape.with_layers(5)
    assert deeper.total_params == meta_param_count(
        "transformer_lm_gpt3_175", vocab=1000, decoder_layers=5, tokens_per_sample=1024
    )


# ------------------------------------------------------------------------------------ hand-computed bytes

# 2 layers x 64 wide, 4 heads, ffn 256 (gpt3: gelu, no dropout, learned positions, tied output projection),
# 32 positions, vocabulary 1000; 2 GPUs, bf16, 2 sequences of 32 tokens (T = 64).
# Layer: q,k,v,out 4 x (64*64 + 64) = 16640; fc1 256*64 + 256 = 16640; fc2 64*256 + 64 = 16448; two norms 256
#   -> P = 49984. Root: embeddings 1000*64 = 64000; positions (32 + 2) * 64 = 2176; final norm 128 -> 66304.
# Every dim 0 is even, so each GPU holds exactly half: 24992 per layer, 33152 of the root, 83136 in all.
SMALL = dict(decoder_layers=2, decoder_embed_dim=64, decoder_attention_heads=4, tokens_per_sample=32)
# Saved per layer: 2 norm inputs and 6 other d-wide tensors, 2 ffn-wide (gelu), fp32 logsumexp per head.
LAYER_ACTIVATIONS = 64 * (2 * 64 * 2 + 6 * 64 * 2 + 2 * 256 * 2 + 4 * 4)  # 132096
WORKSPACE = 64 * (2 * 64 * 2 + max(256 * 2, 3 * 64 * 2 + 4 * 64))  # 57344: attention's dq/dk/dv + fp32 dq dominate


@pytest.fixture(scope="module")
def small_shape():
    shape = mm.model_shape(preset_config("transformer_lm_gpt3_small", **SMALL), 1000)
    assert (shape.layer_params, shape.root_params, shape.total_params) == (49984, 66304, 166272)
    return shape


def small_setup(**changes):
    return dataclasses.replace(mm.TrainingSetup(gpus=2, batch_size=2, tokens_per_sample=32, dtype="bf16"), **changes)


def test_fully_sharded_breakdown_in_exact_bytes(small_shape):
    plan = mm.plan(small_shape, small_setup())
    assert LAYER_ACTIVATIONS == 132096 and WORKSPACE == 57344
    assert plan.snapshot("backward, layer 1").terms == {
        "parameters": 4 * 83136,
        "optimizer_state": 8 * 83136,  # 332544, 665088
        "layers_in_flight": 2 * 2 * 49984,  # its own full parameters + FSDP2's prefetch of layer 0, bf16
        "layer_gradients": 2 * 49984,  # its bf16 gradients (no reduce buffer retained yet: last layer)
        "root_parameters": 2 * 66304,
        "root_gradients": 2 * 64000,  # output projection's gradient
        "activations": 132096 + 132096 + 57344,  # layer 0 saved, layer 1 saved, its backward workspace
    }
    assert plan.snapshot("backward, layer 0").terms == {
        "parameters": 332544,
        "optimizer_state": 665088,
        "gradients": 4 * 24992,
        "layers_in_flight": 2 * 49984,
        "layer_gradients": 2 * 49984 + 4 * 49984,  # + layer 1's fp32 buffer
        "root_parameters": 132608,
        "root_gradients": 128000,
        "activations": 132096 + 57344,
    }
    loss = plan.snapshot("loss backward")
    assert loss.terms == {
        "parameters": 332544,
        "optimizer_state": 665088,
        "root_parameters": 132608,
        "activations": 2 * 132096 + 64 * (64 * 2 + 64 * 2),  # + final norm in/out
        "logits": 12 * 64 * 1000,
    }
    assert loss.total == 2178816
    assert plan.snapshot("embedding backward").total == 332544 + 665088 + 199936 + 199936 + 132608 + 2 * (66304 + 64000)
    assert plan.snapshot("root reduce-scatter").total == 332544 + 665088 + 199936 + 6 * 66304
    assert plan.snapshot("optimizer step").total == 16 * 83136
    assert plan.peak is loss and plan.peak_bytes == 2178816
    assert plan.margin_bytes == int(2178816 * mm.ALLOCATOR_MARGIN_FRACTION) + int(mm.NON_PYTORCH_OVERHEAD_GIB * mm.GIB)
    assert plan.required_bytes == plan.peak_bytes + plan.margin_bytes
    assert plan.host_bytes == 0


def test_flag_effects_in_exact_bytes(small_shape):
    checkpointed = mm.plan(small_shape, small_setup(checkpoint_activations=True))
    assert checkpointed.snapshot("backward, layer 1").terms["activations"] == 64 * 64 * 2 + 132096 + 57344
    assert checkpointed.snapshot("loss backward").terms["activations"] == 2 * 8192 + 16384
    offloaded_acts = mm.plan(small_shape, small_setup(checkpoint_activations=True, offload_activations=True))
    assert offloaded_acts.snapshot("loss backward").terms["activations"] == 16384
    assert offloaded_acts.host_bytes == 2 * 8192

    kept = mm.plan(small_shape, small_setup(reshard_after_forward=False))
    assert kept.snapshot("loss backward").terms["layers_in_flight"] == 2 * 2 * 49984
    assert kept.snapshot("forward, last layer").terms["layers_in_flight"] == 3 * 2 * 49984
    assert kept.snapshot("backward, layer 0").terms["layers_in_flight"] == 2 * 49984

    prefetched = mm.plan(small_shape, small_setup(forward_prefetch=True, prefetch_depth=2))
    assert prefetched.snapshot("forward, last layer").terms["layers_in_flight"] == 4 * 2 * 49984

    offloaded = mm.plan(small_shape, small_setup(cpu_offload=True))
    for snap in offloaded.snapshots:
        assert not {"parameters", "optimizer_state", "gradients"} & set(snap.terms), snap.phase
    assert offloaded.host_bytes == 16 * 83136

    accumulating = mm.plan(small_shape, small_setup(update_freq=4))
    assert accumulating.snapshot("loss backward").terms["gradients"] == 4 * 83136

    fp32 = mm.plan(small_shape, small_setup(dtype="fp32"))
    assert fp32.snapshot("backward, layer 1").terms["layers_in_flight"] == 2 * 4 * 49984

    # --fsdp-sync-free bounds reserved memory (how far the CPU runs ahead), not what is allocated.
    assert mm.plan(small_shape, small_setup(sync_free=True)).snapshots == mm.plan(small_shape, small_setup()).snapshots


def test_replicated_ddp_holds_every_state_on_every_gpu(small_shape):
    plan = mm.plan(small_shape, small_setup(fully_sharded=False, dtype="fp32"))
    step = plan.snapshot("optimizer step").terms
    assert step == {
        "parameters": 4 * 166272,
        "optimizer_state": 8 * 166272,
        "ddp_buckets": 4 * 166272,
        "gradients": 4 * 166272,
    }
    assert "autocast_copies" not in plan.snapshot("loss backward").terms
    autocast = mm.plan(small_shape, small_setup(fully_sharded=False))
    # Linear weights and biases of both layers (not the norms) in bf16, and the output projection.
    assert autocast.snapshot("loss backward").terms["autocast_copies"] == 2 * 2 * (49984 - 256) + 2 * 64000


def test_padding_of_uneven_shards():
    assert mm.sharded_numel([(1000, 64), (34, 64), (64,)], 3) == 334 * 64 + 12 * 64 + 22


# ------------------------------------------------------------------------------------ monotonicity, searches


@pytest.mark.parametrize("arch", ["transformer_lm_gpt3_small", "transformer_lm_gpt3_6_7"])
def test_more_gpus_less_memory_per_gpu_and_checkpointing_saves_activations(arch):
    shape = mm.model_shape(preset_config(arch, tokens_per_sample=2048), 50272)
    setup = mm.TrainingSetup(batch_size=4, dtype="bf16")
    peaks = [mm.plan(shape, dataclasses.replace(setup, gpus=n)).peak_bytes for n in (1, 2, 8, 64)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    plain = mm.plan(shape, setup)
    checkpointed = mm.plan(shape, dataclasses.replace(setup, checkpoint_activations=True))
    for a, b in zip(plain.snapshots, checkpointed.snapshots):
        assert b.terms.get("activations", 0) <= a.terms.get("activations", 0), a.phase
    assert checkpointed.peak_bytes < plain.peak_bytes
    more = [mm.plan(shape, dataclasses.replace(setup, batch_size=b)).peak_bytes for b in (1, 2, 4)]
    assert more == sorted(more) and len(set(more)) == 3


def test_largest_fitting_search():
    assert mm.largest_fitting(lambda k: k <= 37) == 37
    assert mm.largest_fitting(lambda k: k <= 1) == 1
    assert mm.largest_fitting(lambda k: False) == 0
    assert mm.largest_fitting(lambda k: True, limit=100) == 100


def test_largest_batch_is_the_boundary(small_shape):
    setup = small_setup()
    memory = mm.gib(mm.plan(small_shape, dataclasses.replace(setup, batch_size=300)).required_bytes) + 1e-9
    batch = mm.largest_batch(small_shape, setup, memory)
    assert batch == 300
    assert not mm.plan(small_shape, dataclasses.replace(setup, batch_size=301)).fits(memory)
    assert mm.largest_batch(small_shape, setup, 0.5) == 0  # below the 1 GiB outside PyTorch


def test_smallest_gpu_count_and_layers_for_175b():
    shape = mm.model_shape(preset_config("transformer_lm_gpt3_175", tokens_per_sample=2048), 50272)
    setup = mm.TrainingSetup(gpus=2, batch_size=1, dtype="bf16", checkpoint_activations=True, sync_free=True)
    h200 = GPU_MEMORY_GIB["h200"]
    gpus = mm.smallest_gpu_count(shape, setup, h200)
    assert mm.plan(shape, dataclasses.replace(setup, gpus=gpus)).fits(h200)
    assert not mm.plan(shape, dataclasses.replace(setup, gpus=gpus - 1)).fits(h200)
    assert 20 <= gpus <= 32  # 16 bytes x 174.6e9 params over ~110 GiB of state room per GPU
    layers = mm.largest_layer_count(shape, setup, h200)
    assert mm.plan(shape.with_layers(layers), setup).fits(h200)
    assert not mm.plan(shape.with_layers(layers + 1), setup).fits(h200)
    assert 2 <= layers <= 9
    assert mm.smallest_gpu_count(shape, dataclasses.replace(setup, fully_sharded=False), h200) is None


# ------------------------------------------------------------------------------------ calibration


@pytest.mark.parametrize(
    "arch,overrides",
    [
        # FSDP.md's "6.1B": an untied output projection (6,067,126,272 parameters) ...
        (
            "transformer_lm_gpt",
            dict(decoder_learned_pos=True, dropout=0.0, attention_dropout=0.0, decoder_ffn_embed_dim=24576),
        ),
        # ... or tied, as the gpt3 presets build it (5,758,255,104).
        ("transformer_lm_gpt3_6_7", {}),
    ],
)
def test_fsdp_md_reference_point_within_ten_percent(arch, overrides):
    """12 layers x 6144 (48 heads), 2048 tokens, batch 1 per GPU, bf16, 2 GPUs, FSDP2: 49.1 GiB peak
    allocated (../shared/design/FSDP.md)."""
    cfg = preset_config(
        arch, decoder_layers=12, decoder_embed_dim=6144, decoder_attention_heads=48, tokens_per_sample=2048, **overrides
    )
    plan = mm.plan(mm.model_shape(cfg, 50272), mm.TrainingSetup(gpus=2, batch_size=1, dtype="bf16"))
    assert abs(mm.gib(plan.peak_bytes) - 49.1) / 49.1 < 0.10


# ------------------------------------------------------------------------------------ command line


def test_cli_report_and_flag_spelling(capsys):
    args = [
        "--arch",
        "transformer_lm_gpt3_small",
        "--gpus",
        "2",
        "--gpu",
        "h200",
        "--max-sentences",
        "4",
        "--tokens-per-sample",
        "1024",
        "--bf16",
        "--fsdp-sync-free",
        "--fsdp-forward-prefetch",
        "--update-freq",
        "2",
        "--max-layers-that-fit",
    ]
    request = plan_memory.parse(args)
    assert request.gpu_memory_gib == GPU_MEMORY_GIB["h200"]
    assert request.setup == mm.TrainingSetup(
        gpus=2, batch_size=4, tokens_per_sample=1024, dtype="bf16", forward_prefetch=True, sync_free=True, update_freq=2
    )
    assert plan_memory.main(args) == 0
    out = capsys.readouterr().out
    assert f"parameters: {meta_param_count('transformer_lm_gpt3_small', tokens_per_sample=1024)}\n" in out
    assert "per-GPU memory at the peak (" in out and "fits (" in out
    assert "largest --batch-size that fits: " in out
    assert "largest --decoder-layers that fits (this layer shape and these flags): " in out
    assert "recommended: " in out
    assert plan_memory.parse(["--arch", "transformer_lm_gpt3_small", "--max-tokens", "8192"]).setup.batch_size == 4
    assert plan_memory.parse(["--arch", "transformer_lm_gpt3_small"]).gpu_memory_gib == 80.0


def test_cli_recommends_what_fixes_a_plan_that_does_not_fit(capsys):
    plan_memory.main(
        [
            "--arch",
            "transformer_lm_gpt3_175",
            "--gpus",
            "2",
            "--gpu",
            "h200",
            "--bf16",
            "--checkpoint-activations",
            "--fsdp-sync-free",
        ]
    )
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "largest --batch-size that fits: none" in out
    gpus = mm.smallest_gpu_count(
        plan_memory.parse(["--arch", "transformer_lm_gpt3_175"]).shape,
        mm.TrainingSetup(gpus=2, dtype="bf16", checkpoint_activations=True),
        GPU_MEMORY_GIB["h200"],
    )
    assert f"at least {gpus} GPUs" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--bf16", "--fp16"], "--fp16 and --bf16 cannot be combined"),
        (["--ddp-backend", "pytorch_ddp", "--fsdp-sync-free"], "--fsdp-sync-free needs --ddp-backend fully_sharded"),
        (["--optimizer", "sgd"], "--optimizer sgd is not modeled"),
        (
            ["--tokens-per-sample", "4096", "--max-target-positions", "2048"],
            "exceeds the model's --max-target-positions",
        ),
        (["--decoder-attention-heads", "7"], "not divisible by --decoder-attention-heads"),
        (["--gpu-memory-gb", "0"], "--gpu-memory-gb must be a positive finite number, got 0"),
        (["--gpu-memory-gb", "nan"], "--gpu-memory-gb must be a positive finite number, got nan"),
        (["--gpu-memory-gb", "inf"], "--gpu-memory-gb must be a positive finite number, got inf"),
        (["--gpu-memory-gb", "5000"], "--gpu-memory-gb 5000 is more than any GPU holds: at most 1024"),
        (["--achieved-tflops", "nan"], "--achieved-tflops must be a positive finite number, got nan"),
        (["--node-memory-gib", "inf"], "--node-memory-gib must be a positive finite number, got inf"),
        (["--gpus", "1000000000"], "--gpus 1000000000 is out of range: 1 to 131072"),
        (["--gpus", "1e9"], "argument --gpus/--distributed-world-size: invalid int value: '1e9'"),
        (["--gpus", "0"], "--gpus 0 is out of range: 1 to 131072"),
        # the batch options: fairseq-train's own checks (fairseq.dataclass.batch_flags), not "raise --max-tokens"
        (["--max-tokens", "-100"], "--max-tokens -100 must be at least 1: the most tokens in one batch"),
        (["--batch-size", "0"], "--batch-size 0 must be at least 1: the most sentences in one batch"),
        (["--update-freq", "0"], "--update-freq 0: every value must be an integer of at least 1"),
        (["--update-freq", "2,-1"], "--update-freq 2,-1: every value must be an integer of at least 1"),
    ],
)
def test_cli_errors_name_the_flag(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        plan_memory.main(["--arch", "transformer_lm_gpt3_small"] + args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m fairseq.planning.plan_memory: error: "), err
    assert message in err, err


def test_a_model_no_setup_could_hold_is_refused_before_it_is_modelled(capsys):
    """1.8e18 parameters: 16 bytes each exceed 131072 GPUs of 1024 GiB. Refused from the parameter count, with
    at most two layers built (a billion would take minutes and gigabytes)."""
    started = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        plan_memory.main(["--arch", "transformer_lm_gpt3_175", "--decoder-layers", "1000000000"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "python -m fairseq.planning.plan_memory: error: --arch transformer_lm_gpt3_175 with 1000000000 layers x "
        "12288, ffn 49152, vocabulary 50272 has 1.81e+18 parameters, whose training state (16 bytes each: "
        "2.58e+04 PiB) exceeds 131072 GPUs of 1024 GiB, the largest setup the planner takes; lower "
        "--decoder-layers or the widths\n"
    )
    assert time.perf_counter() - started < 10


def test_plans_do_not_grow_with_the_layer_count(capsys):
    """A billion gpt layers (7.1e15 parameters: under the bound) are planned as fast as 12: the shape comes from
    two built layers, a step's walk snapshots at most four layers' backward (memory_model.backward_layers)."""
    request = plan_memory.parse(["--arch", "transformer_lm_gpt", "--decoder-layers", "1000000000"])
    assert request.shape.total_params == 1_000_000_000 * 7_087_872 + 77_219_328
    plan = mm.plan(request.shape, request.setup)
    layers = [s.phase for s in plan.snapshots if s.phase.startswith("backward, layer")]
    assert layers == [
        "backward, layer 999999999",
        "backward, layer 999999998",
        "backward, layer 1",
        "backward, layer 0",
    ]
    assert (
        plan_memory.main(["--arch", "transformer_lm_gpt", "--decoder-layers", "1000000000", "--max-layers-that-fit"])
        == 0
    )
    assert "parameters: 7087872077219328\n" in capsys.readouterr().out


@pytest.mark.parametrize("layers", [0, 1, 2, 3, 7])
def test_the_walk_over_a_few_layers_finds_the_peak_of_every_layer(layers, monkeypatch):
    """backward_layers' claim: the snapshots it keeps hold the peak (phase and bytes) a walk through every layer
    finds, for every FSDP / DDP flag that shapes a layer's backward."""
    shape = mm.model_shape(preset_config("transformer_lm_gpt3_small", **dict(SMALL, decoder_layers=layers)), 1000)
    setups = [
        small_setup(
            **dict(
                zip(
                    (
                        "reshard_after_forward",
                        "forward_prefetch",
                        "prefetch_depth",
                        "update_freq",
                        "checkpoint_activations",
                        "cpu_offload",
                        "gpus",
                    ),
                    values,
                )
            )
        )
        for values in itertools.product(
            (True, False), (True, False), (1, 3), (1, 2), (False, True), (False, True), (2, 8)
        )
    ]
    setups += [
        small_setup(fully_sharded=False, update_freq=u, checkpoint_activations=c, dtype=d)
        for u in (1, 2)
        for c in (False, True)
        for d in ("bf16", "fp32")
    ]
    few = [mm.plan(shape, setup) for setup in setups]
    monkeypatch.setattr(mm, "backward_layers", lambda n, bend=0: list(reversed(range(n))))
    every = [mm.plan(shape, setup) for setup in setups]
    assert [(p.peak.phase, p.peak_bytes, p.host_bytes) for p in few] == [
        (p.peak.phase, p.peak_bytes, p.host_bytes) for p in every
    ]


def test_unknown_arch_lists_the_choices(capsys):
    with pytest.raises(SystemExit):
        plan_memory.main(["--arch", "transformer_lm_gpt5"])
    assert "transformer_lm_gpt3_175" in capsys.readouterr().err


def test_module_runs_as_a_script():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fairseq.planning.plan_memory",
            "--arch",
            "transformer_lm_gpt3_175",
            "--gpus",
            "2",
            "--gpu",
            "h200",
            "--bf16",
            "--checkpoint-activations",
            "--fsdp-sync-free",
            "--max-layers-that-fit",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"parameters: {GPT3_175_PARAMS}" in result.stdout.splitlines()
    assert "largest --decoder-layers that fits" in result.stdout


@pytest.mark.parametrize("prefetch,depth", [(False, 1), (False, 3), (True, 1), (True, 2)])
def test_the_planner_reads_fsdp_prefetch_from_the_settings_apply_fsdp_uses(prefetch, depth):
    """The planner's FSDP settings are fairseq.distributed.fsdp.FSDPSettings, built from the same flags as
    apply_fsdp's; the layers it counts in flight are those of the prefetch plan apply_fsdp hands to FSDP2
    (a middle layer of 6: depth d ahead in both directions with --fsdp-forward-prefetch; none in forward and
    FSDP2's implicit previous unit in backward without)."""
    from argparse import Namespace

    from fairseq.distributed.fsdp import FSDPSettings

    flags = Namespace(
        no_reshard_after_forward=False,
        fsdp_forward_prefetch=prefetch,
        fsdp_prefetch_depth=depth,
        fsdp_sync_free=True,
        cpu_offload=False,
    )
    settings = FSDPSettings.from_flags(flags)
    setup = small_setup(forward_prefetch=prefetch, prefetch_depth=depth, sync_free=True)
    assert setup.fsdp == settings
    plan = settings.prefetch_plan(6)
    assert len(plan.layer_forward[2]) == settings.forward_prefetch_layers == (depth if prefetch else 0)
    assert len(plan.layer_backward[3]) == settings.backward_prefetch_layers == (depth if prefetch else 1)
