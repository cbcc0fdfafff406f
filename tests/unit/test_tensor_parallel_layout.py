"""The parallel layout from the flags, its one-line errors, the tensor-parallel plan on a one-rank mesh (the
DTensor code path without a second process), vocab_parallel_cross_entropy, the Megatron presets, the
planner's tensor-parallel and HSDP numbers and slurm_submit.py --model-parallel-size.

The multi-process behaviour is tests/distributed/test_tensor_parallel.py's."""

import dataclasses
import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fairseq.planning import communication_model as cm
from fairseq.planning import hardware as hw
from fairseq.planning import layouts
from fairseq.planning import memory_model as mm
from fairseq.distributed.mesh import ParallelLayout
from fairseq.distributed.tensor_parallel import apply_tensor_parallel, check_tensor_parallel_shape, split_dims
from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def flags(backend="fully_sharded", tp=1, group=0):
    return SimpleNamespace(ddp_backend=backend, model_parallel_size=tp, fsdp_shard_group_size=group)


# ------------------------------------------------------------------------------------------ layout


@pytest.mark.parametrize(
    "config, world, layout, name",
    [
        (flags(tp=2), 4, ParallelLayout(1, 2, 2), "TP 2 x FSDP 2"),
        (flags(group=2), 4, ParallelLayout(2, 2, 1), "HSDP 2 x 2"),
        (flags(), 4, ParallelLayout(1, 4, 1), "FSDP 4"),
        (flags(tp=2, group=2), 8, ParallelLayout(2, 2, 2), "TP 2 x HSDP 2 x 2"),
        (flags("pytorch_ddp", tp=2), 4, ParallelLayout(2, 1, 2), "TP 2 x 2 replicas"),
        (flags("pytorch_ddp", tp=2), 2, ParallelLayout(1, 1, 2), "TP 2"),
        (flags(), 1, ParallelLayout(1, 1, 1), "1 process"),
    ],
)
def test_layout_from_flags(config, world, layout, name):
    got = ParallelLayout.from_config(config, world)
    assert got == layout and got.world == world and got.describe() == name


def test_ranks_of_a_tp_group_are_consecutive_and_share_a_data_rank():
    layout = ParallelLayout(2, 2, 2)
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [layout.model_parallel_rank(r) for r in range(8)] == [0, 1] * 4


@pytest.mark.parametrize(
    "config, world, message",
    [
        (
            flags(tp=2),
            3,
            "--model-parallel-size 2 does not divide the world size 3: use a world size that is a "
            "multiple of 2, or --model-parallel-size 1",
        ),
        (
            flags(group=3),
            4,
            "--fsdp-shard-group-size 3 does not divide the 4 data-parallel ranks (world size 4 / "
            "--model-parallel-size 1): use --fsdp-shard-group-size 2, or 0 to shard over all 4",
        ),
        (
            flags("pytorch_ddp", group=2),
            4,
            "--fsdp-shard-group-size needs --ddp-backend fully_sharded (got --ddp-backend pytorch_ddp)",
        ),
        (flags(tp=0), 4, "--model-parallel-size must be at least 1 (got 0)"),
    ],
)
def test_bad_layouts_are_one_line_errors(config, world, message):
    with pytest.raises(ValueError) as err:
        ParallelLayout.from_config(config, world)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "tp, heads, ffn, vocab, message",
    [
        (
            8,
            12,
            3072,
            50272,
            "--model-parallel-size 8 does not divide --decoder-attention-heads 12: use "
            "--model-parallel-size 4 (it divides the heads, the FFN width and the vocabulary)",
        ),
        (
            4,
            16,
            4098,
            50272,
            "--model-parallel-size 4 does not divide --decoder-ffn-embed-dim 4098: use "
            "--model-parallel-size 2 (it divides the heads, the FFN width and the vocabulary)",
        ),
        (
            8,
            32,
            12288,
            50265,
            "--model-parallel-size 8 does not divide the vocabulary of 50265 symbols: use "
            "--model-parallel-size 1, or binarize with fairseq-preprocess --padding-factor 8",
        ),
    ],
)
def test_model_dims_that_do_not_split(tp, heads, ffn, vocab, message):
    with pytest.raises(ValueError) as err:
        check_tensor_parallel_shape(tp, heads, ffn, vocab)
    assert str(err.value) == message


def _fairseq_train(argv, capsys):
    from fairseq.utils import run_console_script
    from fairseq_cli.train import cli_main

    with pytest.raises(SystemExit) as exit_info:
        run_console_script("fairseq-train", cli_main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    return exit_info.value.code, err[-1], err


def test_fairseq_train_stops_before_any_process_group(tiny_data, build_train_args, tmp_path, capsys, monkeypatch):
    """Each bad input is one line from fairseq-train, before a process is spawned or a group is created: the
    checks that need the world size run in call_main as soon as it is known, on every rank alike (here as
    rank 1 of a torchrun job of 3)."""
    base = build_train_args(
        tiny_data, tmp_path, max_update=1, arch="transformer_lm_gpt", json_log=False, log_file=False
    )
    code, line, _ = _fairseq_train(base + ["--model-parallel-size", "3", "--decoder-attention-heads", "4"], capsys)
    assert (
        code == 2
        and "--model-parallel-size 3 does not divide --decoder-attention-heads 4: use --model-parallel-size 2" in line
    )
    code, line, _ = _fairseq_train(
        base
        + [
            "--model-parallel-size",
            "3",
            "--decoder-attention-heads",
            "6",
            "--decoder-embed-dim",
            "36",
            "--decoder-ffn-embed-dim",
            "72",
        ],
        capsys,
    )
    assert code == 2 and line.endswith(
        f"does not divide the vocabulary of 64 symbols of {tiny_data}/dict.txt: use "
        "--model-parallel-size 2, or binarize with fairseq-preprocess "
        "--padding-factor 3"
    )
    for name, value in {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(name, value)
    code, line, lines = _fairseq_train(base + ["--model-parallel-size", "2"], capsys)
    assert (code, len(lines)) == (1, 1) and not dist.is_initialized()
    assert line == (
        "fairseq-train: error: --model-parallel-size 2 does not divide the world size 3: use a world size "
        "that is a multiple of 2, or --model-parallel-size 1"
    )


# ------------------------------------------------------------------ the plan on a one-rank mesh (DTensor path)


def tiny_model(tied=True):
    torch.manual_seed(0)
    cfg = preset_config(
        "transformer_lm_megatron_11b",
        decoder_layers=2,
        decoder_embed_dim=32,
        decoder_ffn_embed_dim=64,
        decoder_attention_heads=4,
        dropout=0.0,
        attention_dropout=0.0,
        share_decoder_input_output_embed=tied,
        tokens_per_sample=16,
    )
    return TransformerLanguageModel.build(cfg, 64, 1)


@pytest.mark.parametrize("tied", [True, False])
def test_plan_on_one_rank_trains_as_the_plain_model(one_rank_group, tied):
    """The whole tensor-parallel code path (DTensor parameters, the sequence region, loss_parallel) on a
    one-rank mesh computes what the plain model computes; every parameter is split along the dim split_dims
    (which the memory planner uses) says."""
    from fairseq.criterions.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy

    plain, split = tiny_model(tied), tiny_model(tied)
    dims = split_dims(plain)
    apply_tensor_parallel(split, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)), loss_parallel=True)
    assert (split.decoder.output_projection.weight is split.decoder.embed_tokens.weight) == tied
    for name, param in split.named_parameters():
        assert isinstance(param, DTensor), name
        placement = param.placements[0]
        assert placement.is_replicate() if dims[name] is None else placement.is_shard(dims[name]), (name, placement)
    tokens = torch.randint(2, 64, (3, 16))
    tokens[0, 3] = 1  # a padding symbol: the embedding's padding row gets no gradient
    losses = []
    for model in (plain, split):
        logits = model(tokens[:, :-1])[0]
        loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), tokens[:, 1:].reshape(-1), 1)
        loss.backward()
        losses.append(loss)
    assert isinstance(split(tokens[:, :-1])[0], DTensor)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for name, param in split.named_parameters():
        # Gradients up to ~8 in size, summed in another order (the loss in chunks, the tied embedding's two
        # parts): a few fp32 ulps of the largest terms.
        torch.testing.assert_close(param.grad.full_tensor(), grads[name], rtol=1e-5, atol=2e-5, msg=name)


def test_a_model_without_a_plan_is_refused(one_rank_group):
    from fairseq.models import BaseFairseqModel

    class NoPlan(BaseFairseqModel):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    with pytest.raises(TypeError) as err:
        apply_tensor_parallel(NoPlan(), init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)), loss_parallel=False)
    assert (
        str(err.value) == "--model-parallel-size has a plan for fairseq's TransformerDecoder only, not for "
        "NoneType of NoPlan"
    )


def test_the_plan_is_the_models_data():
    """transformer_lm's plan names every module with parameters (style names, no distributed objects) and
    leaves the modules as built: the attention counts its heads from its projections' width."""
    from fairseq.models.fairseq_model import TENSOR_PARALLEL_STYLES

    model = tiny_model()
    plan = model.tensor_parallel_plan()
    assert set(plan.styles.values()) <= set(TENSOR_PARALLEL_STYLES)
    assert plan.styles["decoder.layers.1.self_attn.q_proj"] == "colwise"
    assert plan.sequence_parallel == ("decoder.layers.0", "decoder.layers.1")
    assert (plan.heads, plan.ffn, plan.vocab) == (4, 64, 64)
    attn = model.decoder.layers[0].self_attn
    x = torch.randn(2, 5, 32)
    half = attn._split_heads(attn.q_proj(x)[..., :16])  # what one rank of two holds after q_proj
    assert half.shape == (2, 2, 5, 8) and attn.num_heads == 4


def test_vocab_parallel_criterion_on_plain_logits_is_cross_entropy():
    from fairseq.criterions.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy

    logits = torch.randn(10, 64, requires_grad=True)
    target = torch.randint(0, 64, (10,))
    target[3] = 1
    got = vocab_parallel_cross_entropy(logits, target, 1)
    want = F.cross_entropy(logits, target, ignore_index=1, reduction="sum")
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------------------------ presets


def test_megatron_presets_have_upstreams_dimensions():
    for arch, ffn, params in (
        ("transformer_lm_megatron", 3072 * 4, 8_313_894_912),
        ("transformer_lm_megatron_11b", 3072 * 6, 11_032_246_272),
    ):
        cfg = preset_config(arch, share_decoder_input_output_embed=True)
        assert (
            cfg.decoder_layers,
            cfg.decoder_embed_dim,
            cfg.decoder_ffn_embed_dim,
            cfg.decoder_attention_heads,
            cfg.activation_fn,
            cfg.dropout,
            cfg.attention_dropout,
        ) == (72, 3072, ffn, 32, "gelu", 0.1, 0.1)
        assert mm.model_shape(cfg, 51200).total_params == params  # 51,200: Megatron's padded GPT-2 vocabulary


# ------------------------------------------------------------------------------------------ planner


@pytest.fixture(scope="module")
def gpt3_175():
    return mm.model_shape(preset_config("transformer_lm_gpt3_175", tokens_per_sample=2048), 50272)


def test_tensor_parallel_splits_the_states_by_the_plan(gpt3_175):
    shape = gpt3_175
    local = mm.local_shape(shape, 8)
    d = shape.embed_dim
    replicated = 4 * d + d + d  # two layer norms (weight, bias), out_proj's and fc2's biases
    assert local.layer_params * 8 == shape.layer_params + 7 * replicated
    assert local.vocab_size * 8 == shape.vocab_size and local.heads == 12
    setup = mm.TrainingSetup(gpus=1024, batch_size=8, dtype="bf16", checkpoint_activations=True, tensor_parallel=8)
    states = mm.plan(shape, setup).snapshot("optimizer step").terms
    assert states["parameters"] == 4 * mm.sharded_numel(local.layer_param_shapes, 128) * 96 + 4 * mm.sharded_numel(
        local.root_param_shapes, 128
    )
    # Sequence parallelism: a checkpointed layer keeps 1/8 of its input.
    assert mm.checkpointed_layer_bytes(local, setup) * 8 == setup.tokens * d * 2


def test_fsdp_traffic_is_the_model_twice_gathered_and_once_reduced(gpt3_175):
    setup = mm.TrainingSetup(gpus=1024, batch_size=1, dtype="bf16", checkpoint_activations=True)
    traffic = {item.what.split(" (")[0]: item for item in cm.step_traffic(gpt3_175, setup)}
    layer = mm.sharded_numel(gpt3_175.layer_param_shapes, 1024) * 1024
    root = mm.sharded_numel(gpt3_175.root_param_shapes, 1024) * 1024
    assert traffic["FSDP all-gather"].bytes == int((2 * 96 * layer + root) * 2 * 1023 / 1024)
    assert traffic["FSDP reduce-scatter"].bytes == int((96 * layer + root) * 4 * 1023 / 1024)
    assert all(item.crosses_nodes for item in traffic.values()) and "TP activations" not in traffic
    hsdp = dataclasses.replace(setup, shard_group=8)  # shards inside a node, replicas across
    by_name = {item.what.split(" (")[0]: item for item in cm.step_traffic(gpt3_175, hsdp)}
    assert not by_name["FSDP all-gather"].crosses_nodes and by_name["replica all-reduce"].crosses_nodes


def test_recommended_layout_for_175b_on_1024_a100(gpt3_175):
    """On OPT's machine (1024 A100-80GB, one 200 Gb/s NIC per GPU) tensor parallelism inside a node wins by far:
    FSDP alone sends 8 times TP 8's bytes across nodes and cannot hide them behind compute. Ranked by estimated
    step time (compute + what communication leaves exposed), TP 4 comes first: at A100 speed a layer's compute
    hides its FSDP traffic, and its per-GPU activation traffic (exposed) is under half of TP 8's. Ranked by
    communication alone, before the step-time model, TP 8 (OPT's layout) came first."""
    setup = mm.TrainingSetup(gpus=1024, batch_size=1, dtype="bf16", checkpoint_activations=True)
    best, *rest = layouts.candidate_layouts(gpt3_175, setup, hw.GPUS["a100-80gb"])
    assert (best.setup.tensor_parallel, best.setup.shard_group, best.setup.batch_size, best.setup.update_freq) == (
        4,
        0,
        4,
        1,
    )
    tp8 = next(c for c in rest if c.setup.tensor_parallel == 8 and c.setup.shard_group == 0)
    fsdp_only = next(c for c in rest if c.setup.tensor_parallel == 1 and c.setup.shard_group == 0)
    assert 7.9 < fsdp_only.inter_node_bytes / tp8.inter_node_bytes < 8.1
    assert best.time.compute == tp8.time.compute == fsdp_only.time.compute
    assert best.time.total < tp8.time.total < 0.5 * fsdp_only.time.total


def test_planner_cli_prints_the_layout_and_its_traffic(capsys):
    from fairseq.planning import plan_memory

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
            "8",
            "--model-parallel-size",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert "layout: TP 8 x FSDP 128 on 1024 GPUs (8 per node)" in out
    assert "TP activations (bf16) over 8 ranks, inside a node" in out
    assert "FSDP all-gather (bf16 parameters) over 128 ranks, across nodes" in out
    with pytest.raises(SystemExit):
        plan_memory.main(["--arch", "transformer_lm_gpt3_175", "--gpus", "3", "--model-parallel-size", "3"])
    assert "does not divide the vocabulary of 50272 symbols of --vocab-size" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ SLURM


def _slurm_submit():
    spec = importlib.util.spec_from_file_location("slurm_submit", os.path.join(ROOT, "scripts", "slurm_submit.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_slurm_submit_with_model_parallel_size(capsys):
    submit = _slurm_submit()
    code = submit.main(
        ["175b", "--nodes", "128", "--gpus-per-node", "8", "--data", "/data", "--dry-run", "--model-parallel-size", "8"]
    )
    out, err = capsys.readouterr()
    assert code == 0
    assert "OVERRIDES=('optimization.update_freq=[8]' distributed_training.model_parallel_size=8)" in out
    assert "128 data-parallel ranks instead of the recipe's 1024 GPUs" in err
    code = submit.main(
        ["175b", "--nodes", "128", "--gpus-per-node", "8", "--data", "/data", "--dry-run", "--model-parallel-size", "3"]
    )
    assert code == 1 and "--model-parallel-size 3 must divide --gpus-per-node 8" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ checkpoints


def test_unreadable_sharded_checkpoints_are_one_line_errors(tmp_path):
    """DCP reshards any layout; what it cannot read (a tensor of another size, a missing shard file) is a
    CheckpointError raised on every rank before DCP's collectives, not a failure inside one."""
    from fairseq.checkpoint import sharded
    from fairseq.checkpoint.io import CheckpointError

    state = {k: v.clone() for k, v in tiny_model().state_dict().items()}
    path = str(tmp_path / "checkpoint_last")
    write = sharded.sharded_write(
        path,
        {"model": state},
        {
            "cfg": {
                "distributed_training": {
                    "distributed_world_size": 4,
                    "model_parallel_size": 2,
                    "ddp_backend": "fully_sharded",
                }
            }
        },
    )
    write.bytes()
    write.publish()
    assert sharded._saved_layout(sharded.read_metadata(path)) == "4 rank(s) (TP 2 x FSDP 2)"
    wider = dict(state, **{"decoder.embed_tokens.weight": torch.zeros(72, 32)})
    with pytest.raises(CheckpointError) as err:
        sharded.load_sharded(path, wider)
    assert str(err.value) == (
        f"{path}: decoder.embed_tokens.weight is stored as [64, 32] but this model's is "
        "[72, 32] (another model size or dictionary); train with the flags and data it was "
        "saved with"
    )
    sharded.load_sharded(path, {k: torch.empty_like(v) for k, v in state.items()})  # readable as it is
    shard = next(name for name in os.listdir(path) if name.endswith(".distcp"))
    os.remove(os.path.join(path, shard))
    with pytest.raises(CheckpointError) as err:
        sharded.load_sharded(path, state)
    assert "is incomplete: shard file(s) " + shard in str(err.value) and "\n" not in str(err.value)


def test_a_run_without_a_mesh_forgets_the_last_one(one_rank_group):
    """In-process runs one after another (tests, notebooks): a DDP run after a sharded one must not read the
    earlier run's layout through get_data_parallel_world_size()."""
    from fairseq.dataclass.configs import FairseqConfig
    from fairseq.distributed import mesh as mesh_module
    from fairseq.distributed.parallelize import parallelize_model
    from fairseq.distributed.utils import get_data_parallel_world_size

    mesh_module.init_parallel_mesh(ParallelLayout(1, 1, 1), "cpu")
    assert mesh_module.current_mesh() is not None and get_data_parallel_world_size() == 1
    cfg = FairseqConfig()
    cfg.model = SimpleNamespace(checkpoint_activations=False, offload_activations=False)
    parallelize_model(tiny_model(), cfg, torch.device("cpu"))  # --ddp-backend pytorch_ddp, one process
    assert mesh_module.current_mesh() is None


def test_tp_mesh_of_one_applies_the_plan_and_trains_as_the_plain_path(tiny_data, monkeypatch, caplog):
    """FAIRSEQ_TP_MESH_OF_ONE=1 (the knob that lets one GPU run the TP code path): a one-process fully_sharded run
    splits the model by its plan on a one-rank tp dimension and trains as the run without it (dropout 0, fp32:
    the same operations on whole tensors, 1e-6 relative); the plan's refusals apply at size 1 too."""
    from fairseq.frontend.validate import validate
    from tests.distributed.test_tensor_parallel import config, train_updates

    caplog.set_level("INFO", logger="fairseq.distributed.tensor_parallel")
    flags = ["--ddp-backend", "fully_sharded", "--update-freq", "4"]
    plain = train_updates(tiny_data, *flags)[0]
    monkeypatch.setenv("FAIRSEQ_TP_MESH_OF_ONE", "1")
    split = train_updates(tiny_data, *flags)[0]
    assert "tensor parallelism over 1 ranks" in caplog.text
    for got, want in zip(split, plain):
        assert abs(got - want) <= 1e-6 * want, (split, plain)
    with pytest.raises(ValueError, match="--adaptive-input is not supported with --model-parallel-size 1"):
        validate(config(tiny_data, *flags, "--adaptive-input", "--adaptive-input-cutoff", "20"))
