"""Upstream's gated convolutional LM recipe (examples/language_model/README.conv.md) through fairseq-train and
fairseq-eval-lm, scaled down: --arch fconv_lm_dauphin_wikitext103 with --optimizer nag, --lr-scheduler
reduce_lr_on_plateau, --criterion adaptive_loss; a resume; --ddp-backend fully_sharded; and upstream-format
fconv_lm checkpoints (fairseq 0.10-0.12 and < 0.10 layouts, --trust-legacy-checkpoint) evaluated against a
direct computation from their tensors."""

import argparse
import math

import pytest
import torch
import torch.nn.functional as F

from fairseq import options
from fairseq.checkpoint.inference import load_model
from fairseq.checkpoint.io import CheckpointError
from fairseq.logging.progress_bar import read_json_log
from fairseq_cli import eval_lm, train
from tests.train_fixtures import spawn_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

PAD = 1
LAYERS = "[(16, 3)] * 2 + [(24, 2, 0), (24, 1, 2)]"
# What makes the README's model tiny: 4 layers of 16-24 (kernels 3, 3, 2, 1), embed dim 8, cutoffs inside the
# 64-symbol test dictionary, 32-token blocks.
TINY = [
    "--decoder-embed-dim",
    "8",
    "--decoder-layers",
    LAYERS,
    "--adaptive-softmax-cutoff",
    "20,40",
    "--tokens-per-sample",
    "32",
]


def readme_argv(data, save_dir, max_epoch, *extra):
    """README.conv.md's command, unchanged apart from sizes (epochs, the model, blocks), --cpu and logging."""
    return [
        "--task",
        "language_modeling",
        str(data),
        "--save-dir",
        str(save_dir),
        "--arch",
        "fconv_lm_dauphin_wikitext103",
        "--max-epoch",
        str(max_epoch),
        "--optimizer",
        "nag",
        "--lr",
        "1.0",
        "--lr-scheduler",
        "reduce_lr_on_plateau",
        "--lr-shrink",
        "0.5",
        "--clip-norm",
        "0.1",
        "--dropout",
        "0.2",
        "--weight-decay",
        "5e-06",
        "--criterion",
        "adaptive_loss",
        "--max-tokens",
        "1024",
        "--ddp-backend=no_c10d",
        *TINY,
        "--cpu",
        "--num-workers",
        "0",
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--log-file",
        str(save_dir / "train.log"),
        *extra,
    ]


def eval_cfg(data, path, *extra):
    parser = options.get_eval_lm_parser()
    args = options.parse_args_and_arch(
        parser, [str(data), "--path", str(path), "--tokens-per-sample", "32", "--cpu", *extra]
    )
    return options.convert_namespace_to_config(args)


def rows(save_dir, tag="train_inner"):
    return read_json_log(save_dir / "train.log", tag=tag)


# ----------------------------------------------------------------------------- the README's recipe


@pytest.fixture(scope="module")
def readme_run(tiny_data, tmp_path_factory):
    save = tmp_path_factory.mktemp("fconv_readme")
    train.cli_main(readme_argv(tiny_data, save, 3))
    return save


def test_readme_command_trains_with_nag_plateau_and_adaptive_loss(readme_run):
    train_rows, valid = rows(readme_run), [float(r["valid_loss"]) for r in rows(readme_run, "valid")]
    assert [int(r["num_updates"]) for r in train_rows] == list(range(1, 22))  # 188 blocks: 7 batches an epoch
    assert int(train_rows[0]["wpb"]) == 1024 and len(valid) == 3
    # reduce_lr_on_plateau (patience 0, threshold 1e-4 relative): after an epoch that does not improve on the
    # best validation loss, the rate is halved
    first_lr = {int(r["epoch"]): float(r["lr"]) for r in reversed(train_rows)}
    expected, lr, best = [1.0], 1.0, math.inf
    for loss in valid[:2]:
        if loss < best * (1 - 1e-4):
            best = loss
        else:
            lr *= 0.5
        expected.append(lr)
    assert [first_lr[e] for e in (1, 2, 3)] == expected
    assert valid[-1] < valid[0]  # it learns
    state = torch.load(readme_run / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    history = state["optimizer_history"][-1]
    assert (history["criterion_name"], history["optimizer_name"]) == ("AdaptiveLoss", "NAG")
    assert state["cfg"]["model"]["_name"] == "fconv_lm_dauphin_wikitext103"
    assert state["cfg"]["model"]["decoder_layers"] == LAYERS and state["cfg"]["model"]["dropout"] == 0.2
    assert "decoder.adaptive_softmax.tail.1.2.weight" in state["model"] and "decoder.fc3.weight_v" not in state["model"]
    assert state["model"]["decoder.convolutions.2.weight_v"].shape == (2, 16, 48)


def test_eval_lm_gives_the_validation_loss_of_the_best_checkpoint(readme_run, tiny_data):
    result = eval_lm.main(eval_cfg(tiny_data, readme_run / "checkpoint_best.pt", "--gen-subset", "valid"))
    best = min(float(r["valid_loss"]) for r in rows(readme_run, "valid"))
    assert result["loss"] == pytest.approx(best, abs=5e-4)  # the log rounds to 3 decimals
    assert result["tokens"] == 619  # every target of the 40 validation lines, with their </s>


def test_resumed_run_repeats_the_uninterrupted_one(readme_run, tiny_data, tmp_path):
    train.cli_main(readme_argv(tiny_data, tmp_path, 1))
    train.cli_main(readme_argv(tiny_data, tmp_path, 3))  # resumes from checkpoint_last (end of epoch 1)
    assert "loaded checkpoint" in (tmp_path / "train.log").read_text()
    keys = ("num_updates", "loss", "lr", "gnorm")
    assert [[r[k] for k in keys] for r in rows(tmp_path)] == [[r[k] for k in keys] for r in rows(readme_run)]
    assert [r["valid_loss"] for r in rows(tmp_path, "valid")] == [r["valid_loss"] for r in rows(readme_run, "valid")]


def test_fully_sharded_on_one_process_trains_as_the_default_backend(readme_run, tiny_data, tmp_path):
    train.cli_main(readme_argv(tiny_data, tmp_path, 1, "--ddp-backend", "fully_sharded"))
    keys = ("num_updates", "loss", "gnorm")
    assert [[r[k] for k in keys] for r in rows(tmp_path)] == [[r[k] for k in keys] for r in rows(readme_run)[:7]]


def _two_rank_worker(rank, meta_port, train_port, argv, state_path):
    """One of 2 gloo ranks. First: the model built on the meta device, sharded by FSDP2, then initialized shard
    by shard (what fairseq-train does from 1e9 parameters on); rank 0 saves the full state. Then: fairseq-train
    as torchrun would start it on this rank."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fairseq.dataclass.configs import FairseqConfig
    from fairseq.distributed.parallelize import parallelize_model
    from fairseq.models.fconv_lm import FConvLanguageModel, preset_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(meta_port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = FairseqConfig()
    cfg.distributed_training.ddp_backend = "fully_sharded"
    cfg.model = preset_config("fconv_lm", decoder_layers=LAYERS, decoder_embed_dim=8)
    with torch.device("meta"):
        model = FConvLanguageModel.build(cfg.model, 64, PAD)
    parallelize_model(model, cfg, torch.device("cpu"), world_mesh=init_device_mesh("cpu", (2,)))
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(state, state_path)
    dist.destroy_process_group()

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(train_port)
    )
    train.cli_main(argv)


def test_fully_sharded_on_two_processes(tiny_data, tmp_path):
    """2 gloo ranks: a meta-device build initialized on its shards as upstream initializes; fairseq-train with
    sharded checkpoints against one process taking the same batches as two micro-batches (dropout 0: the runs
    differ only in summation order), and eval-lm of the sharded directory."""
    from fairseq.runtime.env import get_free_port

    single, sharded = tmp_path / "single", tmp_path / "sharded"
    short = ["--dropout", "0", "--max-update", "3", "--seed", "3"]
    argv = readme_argv(tiny_data, sharded, 1, *short, "--ddp-backend", "fully_sharded", "--use-sharded-state")
    ports = get_free_port("127.0.0.1"), get_free_port("127.0.0.1")
    spawn_ranks(_two_rank_worker, 2, *ports, argv, str(tmp_path / "meta.pt"))

    state = torch.load(tmp_path / "meta.pt", weights_only=True)
    for key, v in state.items():  # weight_g is weight_v's norm (a convolution's spans both ranks' shards)
        if key.endswith("weight_v"):
            dims = (1,) if v.dim() == 2 else (0, 1)
            torch.testing.assert_close(state[key[:-1] + "g"], v.norm(dim=dims, keepdim=True), rtol=0, atol=1e-6)
            assert state[key[: -len("weight_v")] + "bias"].abs().sum() == 0
    assert state["decoder.embed_tokens.weight"][PAD].abs().sum() == 0

    train.cli_main(readme_argv(tiny_data, single, 1, *short, "--update-freq", "2"))
    assert (sharded / "checkpoint_last").is_dir()
    ref = {r["num_updates"]: float(r["loss"]) for r in rows(single)}
    got = {r["num_updates"]: float(r["loss"]) for r in rows(sharded)}
    assert ref.keys() == got.keys() == {"1", "2", "3"}
    assert all(abs(ref[k] - got[k]) <= 0.0015 for k in ref), (ref, got)  # logged with 3 decimals
    # each update takes two batches (of up to 1024 tokens): one per rank, or two micro-batches
    assert [r["wpb"] for r in rows(sharded)] == [r["wpb"] for r in rows(single)]
    assert int(rows(single)[0]["wpb"]) > 1024
    a = eval_lm.main(eval_cfg(tiny_data, sharded / "checkpoint_last", "--gen-subset", "valid"))
    b = eval_lm.main(eval_cfg(tiny_data, single / "checkpoint_last.pt", "--gen-subset", "valid"))
    assert a["tokens"] == b["tokens"] and a["loss"] == pytest.approx(b["loss"], abs=1e-4)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--model-parallel-size", "2"],
            "--model-parallel-size 2 needs a transformer_lm architecture (got --arch fconv_lm_dauphin_wikitext103)",
        ),
        (["--decoder-attention", "True"], "--decoder-attention 'True' is not supported"),
        (
            ["--criterion", "cross_entropy", "--decoder-layers", "[(16, 3)] * 2 + [(24, 2, 4)]"],
            "--decoder-layers: layer 2 takes its residual from 4 layers back",
        ),
    ],
)
def test_what_does_not_apply_is_refused_in_one_line(tiny_data, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        train.cli_main(readme_argv(tiny_data, tmp_path, 1, *flags))
    assert exit_info.value.code != 0
    assert f"error: {message}" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- upstream checkpoints


def upstream_state_dict(vocab=64, embed=8, seed=0):
    """What upstream's FConvDecoder holds for LAYERS under --criterion adaptive_loss with cutoffs 20,40, written
    out by hand: torch's weight_norm on nn.Linear (weight_g [out, 1]) and on ConvTBC with dim=2 (weight_g
    [1, 1, 2 * out], weight_v [kernel, in, 2 * out]); weight_g is not weight_v's norm, so the normalization
    counts; fairseq's AdaptiveSoftmax (head, tails of 24 // 4 and 24 // 16, the version buffer)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    sd = {"decoder.version": torch.tensor([2.0]), "decoder.embed_tokens.weight": rand(vocab, embed)}
    sd["decoder.embed_tokens.weight"][PAD] = 0

    def weight_normed(name, shape_g, shape_v):
        sd.update(
            {
                f"{name}.weight_g": rand(*shape_g).abs() + 0.5,
                f"{name}.weight_v": rand(*shape_v),
                f"{name}.bias": rand(shape_v[0] if len(shape_v) == 2 else shape_v[2], scale=0.1),
            }
        )

    weight_normed("decoder.fc1", (16, 1), (16, embed))
    for i, (n_in, n_out, kernel) in enumerate([(16, 16, 3), (16, 16, 3), (16, 24, 2), (24, 24, 1)]):
        weight_normed(f"decoder.convolutions.{i}", (1, 1, 2 * n_out), (kernel, n_in, 2 * n_out))
    weight_normed("decoder.projections.3", (24, 1), (24, 16))  # layer 3's residual: layer 1's 16-wide output
    sd.update(
        {
            "decoder.adaptive_softmax.version": torch.LongTensor([1]),
            "decoder.adaptive_softmax.head.weight": rand(22, 24),
            "decoder.adaptive_softmax.tail.0.0.weight": rand(6, 24),
            "decoder.adaptive_softmax.tail.0.2.weight": rand(20, 6),
            "decoder.adaptive_softmax.tail.1.0.weight": rand(1, 24),
            "decoder.adaptive_softmax.tail.1.2.weight": rand(24, 1),
        }
    )
    return sd


def write_upstream_checkpoint(path, kind, sd):
    """As upstream's fairseq-train saves it. "cfg" (fairseq 0.10-0.12): a plain dict of groups, the model's an
    argparse Namespace of every option (fconv_lm has no dataclass). "args" (fairseq < 0.10): one Namespace."""
    model_args = dict(
        arch="fconv_lm_dauphin_wikitext103",
        dropout=0.2,
        decoder_embed_dim=8,
        decoder_layers=LAYERS,
        decoder_attention="False",
        adaptive_softmax_cutoff="20,40",
        adaptive_softmax_dropout=0,
        decoder_out_embed_dim=None,
        criterion="adaptive_loss",
        optimizer="nag",
        lr=[1.0],
        lr_scheduler="reduce_lr_on_plateau",
        lr_shrink=0.5,
        clip_norm=0.1,
        weight_decay=5e-06,
        max_tokens=1024,
        tokens_per_sample=1024,
        ddp_backend="no_c10d",
        task="language_modeling",
        data="data-bin/wikitext-103",
        sample_break_mode="none",
        seed=1,
        max_epoch=35,
    )
    task_args = dict(
        data="data-bin/wikitext-103",
        tokens_per_sample=1024,
        sample_break_mode="none",
        output_dictionary_size=-1,
        self_target=False,
        future_target=False,
        past_target=False,
        add_bos_token=False,
        max_target_positions=None,
    )
    if kind == "args":
        config = dict(args=argparse.Namespace(**model_args))
    else:
        config = dict(
            args=None,
            cfg={
                "common": {"seed": 1, "cpu": False, "fp16": False},
                "task": dict(task_args, _name="language_modeling"),
                "model": argparse.Namespace(**model_args, _name="fconv_lm_dauphin_wikitext103"),
                "criterion": {"_name": "adaptive_loss", "sentence_avg": False},
                "optimizer": {"_name": "nag", "momentum": 0.99, "weight_decay": 5e-06, "lr": [1.0]},
                "lr_scheduler": {"_name": "reduce_lr_on_plateau", "lr_shrink": 0.5, "lr_threshold": 1e-4},
            },
        )
    torch.save(
        dict(
            config,
            model=sd,
            optimizer_history=[
                {
                    "criterion_name": "AdaptiveLoss",
                    "optimizer_name": "FairseqNAG",
                    "lr_scheduler_state": {"best": 3.9},
                    "num_updates": 100,
                }
            ],
            extra_state={"epoch": 35, "val_loss": 3.9},
            last_optimizer_state=None,
        ),
        path,
    )


def direct_features(sd, tokens):
    """Upstream's FConvDecoder (eval) from the tensors, float64, time-major ConvTBC as upstream runs it: padded
    by kernel - 1 on both sides and the last kernel - 1 steps cut off; GLU; residuals scaled by sqrt(0.5)."""

    def weight(prefix, dim):
        v, g = sd[prefix + "weight_v"], sd[prefix + "weight_g"]
        return v * (g / v.norm(dim=[d for d in range(v.dim()) if d != dim], keepdim=True))

    def linear(prefix, x):
        return x @ weight(prefix, 0).t() + sd[prefix + "bias"]

    x = linear("decoder.fc1.", sd["decoder.embed_tokens.weight"][tokens])[:, None]  # T x B=1 x C
    outputs = [x]
    for i, (kernel, residual_from) in enumerate([(3, 1), (3, 1), (2, 0), (1, 2)]):
        residual = outputs[-residual_from] if residual_from else None
        if i == 3:
            residual = linear("decoder.projections.3.", residual)
        prefix = f"decoder.convolutions.{i}."
        y = torch.conv_tbc(x.contiguous(), weight(prefix, 2), sd[prefix + "bias"], kernel - 1)
        x = F.glu(y[: y.size(0) - (kernel - 1)], dim=2)
        if residual is not None:
            x = (x + residual) * math.sqrt(0.5)
        outputs.append(x)
    return x[:, 0]


def direct_log_prob(sd, x, word, cutoffs=(20, 40, 64)):
    """The adaptive softmax written out: the head's log-softmax, or a tail's cluster plus its log-softmax."""
    head = torch.log_softmax(sd["decoder.adaptive_softmax.head.weight"] @ x, -1)
    band = next(i for i, c in enumerate(cutoffs) if word < c)
    if band == 0:
        return head[word]
    tail = f"decoder.adaptive_softmax.tail.{band - 1}."
    scores = sd[tail + "2.weight"] @ (sd[tail + "0.weight"] @ x)
    return head[cutoffs[0] + band - 1] + torch.log_softmax(scores, -1)[word - cutoffs[band - 1]]


@pytest.fixture(scope="module")
def upstream_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fconv_upstream")
    sd = upstream_state_dict()
    for kind in ("cfg", "args"):
        write_upstream_checkpoint(root / f"{kind}.pt", kind, sd)
    return root, sd


@pytest.mark.parametrize("kind", ["cfg", "args"])
def test_upstream_checkpoint_evaluates_to_the_direct_perplexity(upstream_files, tiny_data, kind):
    root, sd = upstream_files
    path = root / f"{kind}.pt"
    result = eval_lm.main(eval_cfg(tiny_data, path, "--trust-legacy-checkpoint", "--gen-subset", "test"))

    loaded = load_model(str(path), overrides={"data": str(tiny_data), "tokens_per_sample": 32}, trust_legacy=True)
    state = loaded.model.state_dict()  # loaded with strict=True: upstream's names, every one
    assert state.keys() == sd.keys()
    assert all(torch.equal(state[k], sd[k].to(state[k].dtype)) for k in sd)
    sd64 = {k: v.double() for k, v in sd.items()}
    loaded.task.load_dataset("test")
    ds = loaded.task.dataset("test")
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(ds)):
            item = ds[i]
            for x, word in zip(direct_features(sd64, item["source"]), item["target"].tolist()):
                if word != PAD:
                    total -= float(direct_log_prob(sd64, x, word))
                    count += 1
    mean_bits = total / count / math.log(2)
    assert result["tokens"] == count == 596
    assert result["loss"] == pytest.approx(mean_bits, rel=1e-6)  # fp32 evaluation vs float64
    assert result["perplexity"] == pytest.approx(2**mean_bits, rel=1e-5)


def test_upstream_checkpoint_needs_trust_legacy_checkpoint(upstream_files, tiny_data):
    root, _ = upstream_files
    with pytest.raises(CheckpointError, match="--trust-legacy-checkpoint"):
        eval_lm.main(eval_cfg(tiny_data, root / "cfg.pt"))
