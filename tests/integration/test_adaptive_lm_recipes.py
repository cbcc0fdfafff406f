"""Upstream's adaptive-input recipe (examples/language_model/README.adaptive_inputs.md) through fairseq-train and
fairseq-eval-lm, an upstream-format adaptive-input checkpoint (--trust-legacy-checkpoint) evaluated against a
direct computation from its tensors, and --lr-scheduler reduce_lr_on_plateau stepped by fairseq-train at
epoch ends (and resumed)."""

import argparse
import math

import pytest
import torch
from omegaconf import OmegaConf

from fairseq import options
from fairseq.checkpoint.inference import load_model
from fairseq.dataclass.utils import config_to_dict
from fairseq.logging.progress_bar import read_json_log
from fairseq.models.transformer_lm import preset_config
from fairseq_cli import eval_lm, train
from fairseq_cli.preprocess import cli_main as preprocess

from tests.train_fixtures import write_corpus

PAD = 1
# What makes the README's model tiny: 2 layers of 32, and cutoffs inside the 64-symbol test dictionary.
TINY_WIKI103 = [
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "32",
    "--decoder-ffn-embed-dim",
    "64",
    "--decoder-attention-heads",
    "2",
    "--decoder-input-dim",
    "32",
    "--decoder-output-dim",
    "32",
    "--adaptive-input-cutoff",
    "20,40",
    "--adaptive-softmax-cutoff",
    "20,40",
]


def readme_argv(data, save_dir):
    """README.adaptive_inputs.md's command, unchanged apart from sizes (updates, tokens, the model), --cpu."""
    return [
        "--task",
        "language_modeling",
        str(data),
        "--save-dir",
        str(save_dir),
        "--arch",
        "transformer_lm_wiki103",
        "--max-update",
        "6",
        "--lr",
        "1.0",
        "--t-mult",
        "2",
        "--lr-period-updates",
        "4",
        "--lr-scheduler",
        "cosine",
        "--lr-shrink",
        "0.75",
        "--warmup-updates",
        "2",
        "--warmup-init-lr",
        "1e-07",
        "--stop-min-lr",
        "1e-09",
        "--optimizer",
        "nag",
        "--min-lr",
        "0.0001",
        "--clip-norm",
        "0.1",
        "--criterion",
        "adaptive_loss",
        "--max-tokens",
        "64",
        "--update-freq",
        "3",
        "--tokens-per-sample",
        "32",
        "--seed",
        "1",
        "--sample-break-mode",
        "none",
        "--skip-invalid-size-inputs-valid-test",
        "--ddp-backend=no_c10d",
        *TINY_WIKI103,
        "--cpu",
        "--num-workers",
        "0",
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--log-file",
        str(save_dir / "train.log"),
    ]


def eval_cfg(data, path, *extra):
    parser = options.get_eval_lm_parser()
    args = options.parse_args_and_arch(
        parser,
        [
            str(data),
            "--path",
            str(path),
            "--gen-subset",
            "test",
            "--tokens-per-sample",
            "32",
            "--batch-size",
            "4",
            "--cpu",
            *extra,
        ],
    )
    return options.convert_namespace_to_config(args)


def band_log_prob(head, tails, cutoffs, x, word):
    """log p(word | x), the adaptive softmax written out: head log-softmax, or the band's cluster log-prob plus
    the tail's log-softmax. `tails[i]` maps x to band i+1's scores."""
    head_lsm = torch.log_softmax(head(x), -1)
    band = next(i for i, c in enumerate(cutoffs) if word < c)
    if band == 0:
        return head_lsm[word]
    return head_lsm[cutoffs[0] + band - 1] + torch.log_softmax(tails[band - 1](x), -1)[word - cutoffs[band - 1]]


def direct_mean_bits(task, features_of, head, tails, cutoffs):
    """Mean -log2 p over the test split's targets, block by block, in float64."""
    task.load_dataset("test")
    ds = task.dataset("test")
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(ds)):
            item = ds[i]
            features = features_of(item["source"])
            for x, word in zip(features, item["target"].tolist()):
                if word != PAD:
                    total -= float(band_log_prob(head, tails, cutoffs, x, word))
                    count += 1
    return total / count / math.log(2), count


# ----------------------------------------------------------------------------- the README's recipe


@pytest.fixture(scope="module")
def readme_run(tiny_data, tmp_path_factory):
    save = tmp_path_factory.mktemp("adaptive_readme")
    train.cli_main(readme_argv(tiny_data, save))
    return save


def test_readme_command_trains_with_nag_and_adaptive_loss(readme_run):
    rows = read_json_log(readme_run / "train.log")
    assert [int(r["num_updates"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert float(rows[0]["lr"]) == pytest.approx(1e-7 + (1.0 - 1e-7) / 2, rel=1e-5)  # cosine warmup
    assert int(rows[0]["wpb"]) == 3 * 64  # --update-freq 3 x --max-tokens 64
    state = torch.load(readme_run / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["optimizer_history"][-1]["criterion_name"] == "AdaptiveLoss"
    assert state["optimizer_history"][-1]["optimizer_name"] == "NAG"
    assert state["cfg"]["model"]["_name"] == "transformer_lm_wiki103"
    assert "momentum_buffer" in next(iter(state["last_optimizer_state"]["state"].values()))
    assert "decoder.adaptive_softmax.tail.1.2.weight" in state["model"]
    assert "decoder.output_projection.weight" not in state["model"]


def test_eval_lm_of_the_trained_model_equals_the_written_out_adaptive_softmax(readme_run, tiny_data):
    ckpt = readme_run / "checkpoint_last.pt"
    result = eval_lm.main(eval_cfg(tiny_data, ckpt))
    loaded = load_model(str(ckpt), overrides={"data": str(tiny_data), "tokens_per_sample": 32})
    model = loaded.model.double().eval()
    sm = model.decoder.adaptive_softmax
    mean_bits, count = direct_mean_bits(
        loaded.task, lambda src: model(src[None], features_only=True)[0][0], sm.head, [t for t in sm.tail], sm.cutoff
    )
    assert result["tokens"] == count
    assert result["loss"] == pytest.approx(mean_bits, rel=1e-6)  # fp32 evaluation vs float64
    assert result["perplexity"] == pytest.approx(2**mean_bits, rel=1e-5)


# ----------------------------------------------------------------------------- an upstream checkpoint


def upstream_wiki103_checkpoint(path, kind, vocab=64, dim=32, seed=0):
    """What upstream's fairseq-train writes for `--arch transformer_lm_wiki103` (here 0 layers of width 32,
    cutoffs 20,40): its decoder state dict (tied tensors under both of their names, as torch.save keeps
    them) and its config, an argparse Namespace ("args", fairseq < 0.10) or an omegaconf DictConfig ("cfg")."""
    g = torch.Generator().manual_seed(seed)
    bands, dims = [(0, 20), (20, 40), (40, vocab)], [dim, dim // 4, dim // 16]
    sd = {
        "decoder.version": torch.tensor([3.0]),
        "decoder.embed_tokens._float_tensor": torch.zeros(1),
        "decoder.embed_positions._float_tensor": torch.zeros(1),
        "decoder.adaptive_softmax.version": torch.LongTensor([1]),
        "decoder.adaptive_softmax.head._float_tensor": torch.zeros(1),
        "decoder.adaptive_softmax.head.class_proj.weight": torch.randn(2, dim, generator=g) * 0.3,
    }
    for b, ((lo, hi), d) in enumerate(zip(bands, dims)):
        table = torch.randn(hi - lo, d, generator=g) * d**-0.5
        projection = torch.randn(dim, d, generator=g) * 0.3
        sd[f"decoder.embed_tokens.embeddings.{b}.0.weight"] = table
        sd[f"decoder.embed_tokens.embeddings.{b}.1.weight"] = projection
        if b == 0:
            sd["decoder.adaptive_softmax.head.word_proj.weight"] = table
        else:  # tie_adaptive_weights and tie_adaptive_proj
            sd[f"decoder.adaptive_softmax.tail.{b - 1}.0.weight"] = projection
            sd[f"decoder.adaptive_softmax.tail.{b - 1}.2.weight"] = table
    model_args = config_to_dict(
        preset_config(
            "transformer_lm_wiki103",
            decoder_layers=0,
            decoder_embed_dim=dim,
            decoder_input_dim=dim,
            decoder_output_dim=dim,
            decoder_ffn_embed_dim=4 * dim,
            decoder_attention_heads=2,
            adaptive_input_cutoff="20,40",
            adaptive_softmax_cutoff="20,40",
        )
    )
    model_args.pop("_name", None)
    task_args = dict(
        data="data-bin/wikitext-103",
        tokens_per_sample=3072,
        sample_break_mode="none",
        output_dictionary_size=-1,
        self_target=False,
        future_target=False,
        past_target=False,
        add_bos_token=False,
        max_target_positions=None,
    )
    train_args = dict(
        criterion="adaptive_loss",
        optimizer="nag",
        lr=[1.0],
        momentum=0.99,
        weight_decay=0.0,
        lr_scheduler="cosine",
        max_update=286000,
        clip_norm=0.1,
        ddp_backend="no_c10d",
        seed=1,
    )
    if kind == "args":
        flat = dict(model_args, **task_args, **train_args, arch="transformer_lm_wiki103", task="language_modeling")
        config = dict(args=argparse.Namespace(**flat))
    else:
        config = dict(
            args=None,
            cfg=OmegaConf.create(
                {
                    "model": dict(model_args, _name="transformer_lm_wiki103", arch="transformer_lm_wiki103"),
                    "task": dict(task_args, _name="language_modeling"),
                    "criterion": {"_name": "adaptive_loss", "sentence_avg": False},
                    "optimizer": {"_name": "nag", "momentum": 0.99, "weight_decay": 0.0, "lr": [1.0]},
                }
            ),
        )
    torch.save(
        dict(
            config,
            model=sd,
            optimizer_history=[
                {
                    "criterion_name": "AdaptiveLoss",
                    "optimizer_name": "FairseqNAG",
                    "lr_scheduler_state": {"best": 3.2},
                    "num_updates": 286000,
                }
            ],
            extra_state={"epoch": 20, "val_loss": 3.2},
            last_optimizer_state=None,
        ),
        path,
    )
    return sd


def sinusoidal(positions, dim):
    """Upstream's sinusoidal positions (sin then cos halves, frequencies 10000 ** (-i / (half - 1)))."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float64) * -(math.log(10000) / (half - 1)))
    angles = positions.double()[:, None] * freqs[None]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


@pytest.mark.parametrize("kind", ["args", "cfg"])
def test_upstream_adaptive_checkpoint_evaluates_to_the_direct_perplexity(tiny_data, tmp_path, kind):
    path = tmp_path / "adaptive_lm_wiki103.pt"
    sd = {k: v.double() for k, v in upstream_wiki103_checkpoint(path, kind).items()}
    result = eval_lm.main(eval_cfg(tiny_data, path, "--trust-legacy-checkpoint"))

    dim, cutoffs = 32, [20, 40, 64]

    def features_of(src):  # 0 layers and no final norm: scaled adaptive input plus positions
        rows = []
        for t in src.tolist():
            b = next(i for i, c in enumerate(cutoffs) if t < c)
            lo = cutoffs[b - 1] if b else 0
            table = sd[f"decoder.embed_tokens.embeddings.{b}.0.weight"]
            projection = sd[f"decoder.embed_tokens.embeddings.{b}.1.weight"]
            rows.append(projection @ table[t - lo])
        return math.sqrt(dim) * torch.stack(rows) + sinusoidal(torch.arange(len(rows)) + PAD + 1, dim)

    head_words, head_classes = (
        sd["decoder.adaptive_softmax.head.word_proj.weight"],
        sd["decoder.adaptive_softmax.head.class_proj.weight"],
    )
    tails = [
        lambda x, i=i: (
            sd[f"decoder.adaptive_softmax.tail.{i}.2.weight"]
            @ (sd[f"decoder.adaptive_softmax.tail.{i}.0.weight"].t() @ x)
        )
        for i in range(2)
    ]
    head = lambda x: torch.cat([head_words @ x, head_classes @ x])  # noqa: E731
    loaded = load_model(str(path), overrides={"data": str(tiny_data), "tokens_per_sample": 32}, trust_legacy=True)
    mean_bits, count = direct_mean_bits(loaded.task, features_of, head, tails, cutoffs)
    assert result["tokens"] == count
    assert result["loss"] == pytest.approx(mean_bits, rel=1e-6)
    assert result["perplexity"] == pytest.approx(2**mean_bits, rel=1e-5)
    model = loaded.model  # upstream's tying, restored
    assert model.decoder.adaptive_softmax.tail[0][2].weight is model.decoder.embed_tokens.embeddings[1][0].weight


def test_an_adaptive_softmax_from_before_upstreams_version_1_is_refused(tiny_data, tmp_path):
    path = tmp_path / "old.pt"
    upstream_wiki103_checkpoint(path, "args")
    state = torch.load(path, weights_only=False)
    del state["model"]["decoder.adaptive_softmax.version"]
    torch.save(state, path)
    with pytest.raises(ValueError, match="decoder.adaptive_softmax has no version"):
        eval_lm.main(eval_cfg(tiny_data, path, "--trust-legacy-checkpoint"))


# ----------------------------------------------------------------------------- reduce_lr_on_plateau


@pytest.fixture(scope="module")
def short_epochs(tmp_path_factory):
    """A corpus of 60 lines (about 900 tokens): epochs of 1 update at --max-tokens 2048."""
    root = tmp_path_factory.mktemp("short_epochs")
    for name, lines, seed in (("train", 60, 11), ("valid", 10, 12)):
        write_corpus(root / f"{name}.txt", lines, seed=seed)
    preprocess(
        [
            "--only-source",
            "--trainpref",
            str(root / "train.txt"),
            "--validpref",
            str(root / "valid.txt"),
            "--destdir",
            str(root / "data-bin"),
            "--workers",
            "1",
        ]
    )
    return root / "data-bin"


def plateau_argv(build_train_args, data, save_dir, max_epoch):
    """The tiny transformer_lm (adam, --lr 0.002), one update an epoch; improving needs a 50% lower validation
    loss (never happens after the first epoch) and patience is 1: the rate halves at the end of epoch 3."""
    return build_train_args(
        data,
        save_dir,
        "--lr-scheduler",
        "reduce_lr_on_plateau",
        "--lr-shrink",
        "0.5",
        "--lr-threshold",
        "0.5",
        "--lr-patience",
        "1",
        "--max-epoch",
        str(max_epoch),
        "--max-tokens",
        "2048",
        max_update=1000,
    )


def epoch_lrs(log):
    """The rate of each epoch's first update, and the epochs' validation losses."""
    first_lr = {}
    for r in read_json_log(log):
        first_lr.setdefault(int(r["epoch"]), float(r["lr"]))
    valid = [float(r["valid_loss"]) for r in read_json_log(log, tag="valid")]
    return [first_lr[e] for e in sorted(first_lr)], valid


def test_plateau_is_stepped_at_epoch_ends_and_resumed_from_the_checkpoint(short_epochs, tmp_path, build_train_args):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train.cli_main(plateau_argv(build_train_args, short_epochs, straight, 4))
    lrs, valid = epoch_lrs(straight / "train.log")
    assert len(valid) == 4 and lrs == [0.002, 0.002, 0.002, 0.001]

    train.cli_main(plateau_argv(build_train_args, short_epochs, resumed, 3))
    # checkpoint_last is written at the end of epoch 3, before the epoch-end step: one bad epoch (2) so far
    saved = torch.load(resumed / "checkpoint_last.pt", weights_only=True)["extra_state"]["trainer"]["lr_scheduler"]
    assert saved["num_bad_epochs"] == 1 and saved["last_epoch"] == 2 and saved["best"] == valid[0]
    train.cli_main(plateau_argv(build_train_args, short_epochs, resumed, 4))
    assert epoch_lrs(resumed / "train.log") == (lrs, valid)
