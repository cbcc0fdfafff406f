"""Resume, reset and stop edge cases of fairseq-train, and eval-lm's optional outputs."""

import json
import math
import os

import pytest
import torch

from fairseq.logging.progress_bar import read_json_log
from fairseq_cli import eval_lm, train
from test_train_cli import _eval_cfg, _run_train, load
from tests.train_fixtures import train_in_process


def test_no_checkpoint_is_written_with_non_finite_weights(tiny_data, tmp_path, nan_after_two, train_args):
    save_dir = tmp_path / "ck"
    argv = train_args(
        tiny_data,
        save_dir,
        "--user-dir",
        str(nan_after_two),
        "--criterion",
        "nan_after_two",
        "--save-interval-updates",
        "4",
        max_update=8,
    )
    argv[argv.index("--log-interval") + 1] = "10"  # the NaN must be caught before the log boundary
    proc = _run_train(argv)
    assert proc.returncode != 0
    assert "no checkpoint was written" in proc.stderr + proc.stdout
    for name in os.listdir(save_dir):
        if name.endswith(".pt"):
            state = load(save_dir / name)
            assert all(torch.isfinite(v).all() for v in state["model"].values()), name


def test_reset_optimizer_restarts_updates_and_schedule(tiny_data, tmp_path, train_args):
    train.cli_main(train_args(tiny_data, tmp_path, max_update=6))
    train.cli_main(train_args(tiny_data, tmp_path, "--reset-optimizer", max_update=3))
    state = load(tmp_path / "checkpoint_last.pt")
    assert state["extra_state"]["trainer"]["num_updates"] == 3
    lrs = [float(r["lr"]) for r in read_json_log(tmp_path / "train.log")]
    # inverse_sqrt warm-up over 4 updates: the second run starts its warm-up again
    assert lrs[6:9] == lrs[0:3]


def test_best_loss_is_tracked_with_no_save(tiny_data, tmp_path, train_args):
    argv = train_args(tiny_data, tmp_path, "--no-save", "--validate-interval-updates", "2", max_update=6)
    train.cli_main(argv)
    valid = read_json_log(tmp_path / "train.log", "valid")
    losses = [float(v["valid_loss"]) for v in valid]
    assert [float(v["valid_best_loss"]) for v in valid] == [min(losses[: i + 1]) for i in range(len(losses))]
    assert not any(name.endswith(".pt") for name in os.listdir(tmp_path))


def test_resuming_at_an_epoch_boundary_starts_the_epoch_meters_afresh(tiny_data, tmp_path, train_args):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train.cli_main(train_args(tiny_data, straight, "--max-epoch", "2", max_update=0))
    train.cli_main(train_args(tiny_data, resumed, "--max-epoch", "1", max_update=0))
    train.cli_main(train_args(tiny_data, resumed, "--max-epoch", "2", max_update=0))
    a, b = read_json_log(straight / "train.log", "train"), read_json_log(resumed / "train.log", "train")
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]


def test_the_saves_seconds_start_afresh_after_a_resume(tiny_data, tmp_path, train_args):
    """Mid-epoch the saved meters are restored, but not save_blocked / save_wall: they are this run's saves'
    (the save at update 6 was in the first line after the resume, at update 9, which saw none)."""

    def argv(max_update):
        args = train_args(
            tiny_data, tmp_path, "--save-interval-updates", "2", "--disable-validation", max_update=max_update
        )
        args[args.index("--log-interval") + 1] = "3"
        return args

    train.cli_main(argv(8))
    first = {int(r["num_updates"]): r for r in read_json_log(tmp_path / "train.log")}
    assert "save_blocked" in first[3] and "save_blocked" in first[6]  # the saves at 2 and at 4
    train.cli_main(argv(12))
    resumed = [r for r in read_json_log(tmp_path / "train.log") if int(r["num_updates"]) > 8]
    assert [int(r["num_updates"]) for r in resumed] == [9, 12]
    assert "save_blocked" not in resumed[0] and "save_wall" not in resumed[0]
    assert "save_blocked" in resumed[1] and "save_wall" in resumed[1]  # the save at 10


def test_stop_time_hours_stops_every_rank_at_the_same_update(tiny_data, tmp_path, train_args):
    argv = train_args(
        tiny_data,
        tmp_path,
        "--stop-time-hours",
        "0.0004",
        "--distributed-world-size",
        "2",
        "--max-epoch",
        "50",
        "--disable-validation",
        max_update=0,
    )
    status, out, err = train_in_process(argv)  # the 2 ranks spawned from this process
    assert status == 0, out[-3000:] + err[-3000:]
    assert "stopping training:" in (tmp_path / "train.log").read_text()  # the ranks' log (--log-file)
    assert load(tmp_path / "checkpoint_last.pt")["extra_state"]["trainer"]["num_updates"] > 0


def test_eval_lm_results_path_and_word_output(tiny_data, tmp_path, caplog, train_args):
    train.cli_main(train_args(tiny_data, tmp_path, max_update=2))
    ckpt = tmp_path / "checkpoint_last.pt"
    result = eval_lm.main(_eval_cfg(tiny_data, ckpt, "--results-path", str(tmp_path / "results"), "--quiet"))
    written = json.loads((tmp_path / "results" / "eval_lm.test.json").read_text())
    assert written["tokens"] == result["tokens"] and math.isclose(written["loss"], result["loss"])

    caplog.clear()
    with caplog.at_level("INFO", logger="fairseq_cli.eval_lm"):
        again = eval_lm.main(_eval_cfg(tiny_data, ckpt, "--output-word-probs", "--output-word-stats"))
    assert again == result
    messages = [r.getMessage() for r in caplog.records if r.name == "fairseq_cli.eval_lm"]
    # "<sample id> word [log p]\tword [log p]..." per sample; this corpus has no BPE, so a word is a token
    sample_lines = [m for m in messages if m.split(" ", 1)[0].isdigit() and "[" in m]
    words = [w for line in sample_lines for w in line.split(" ", 1)[1].split("\t")]
    assert len(words) == result["tokens"]
    total_nats = sum(float(w.rsplit("[", 1)[1].rstrip("]")) for w in words)
    # printed with 6 decimals per word: the sum matches the loss to well within 1e-6 per word
    assert total_nats == pytest.approx(-result["loss"] * math.log(2) * result["tokens"], abs=1e-6 * len(words))
    stats = [m.split("\t") for m in messages if m.count("\t") == 5 and "[" not in m]
    assert sum(int(s[1]) for s in stats) == result["tokens"]
    assert [int(s[1]) for s in stats] == sorted((int(s[1]) for s in stats), reverse=True)
    assert sum(float(s[2]) for s in stats) == pytest.approx(total_nats, abs=1e-6 * len(words))

    # --remove-bpe MARKER: tokens ending with it join the next one; the same total, counted per word
    merged = eval_lm.main(_eval_cfg(tiny_data, ckpt, "--remove-bpe", "1"))  # w1, w11, w21, ... are pieces
    assert merged["tokens"] == result["tokens"] and merged["words"] < result["tokens"]
    assert merged["loss"] * merged["words"] == pytest.approx(result["loss"] * result["tokens"], rel=1e-9)


def test_context_window_with_bos_counts_each_text_token_once(tiny_data, tmp_path, train_args):
    train.cli_main(train_args(tiny_data, tmp_path / "bos", "--add-bos-token", max_update=2))
    ckpt = tmp_path / "bos" / "checkpoint_last.pt"
    plain = eval_lm.main(_eval_cfg(tiny_data, ckpt))
    windowed = eval_lm.main(_eval_cfg(tiny_data, ckpt, "--context-window", "8"))
    assert windowed["tokens"] == plain["tokens"]


def test_eval_lm_names_an_architecture_mismatch(tiny_data, tmp_path, train_args):
    from fairseq.checkpoint.io import CheckpointError

    train.cli_main(train_args(tiny_data, tmp_path, max_update=1))
    cfg = _eval_cfg(tiny_data, tmp_path / "checkpoint_last.pt", "--model-overrides", "{'decoder_layers': 3}")
    with pytest.raises(CheckpointError, match="different architecture .*missing 16 parameter"):
        eval_lm.main(cfg)


UPSTREAM_STYLE_PLUGIN = """
import math
from dataclasses import dataclass, field

import torch.nn.functional as F
from omegaconf import II

from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.dataclass import FairseqDataclass
from fairseq.models import register_model_architecture
from fairseq.models.transformer_lm import base_lm_architecture


@dataclass
class SmoothedLMConfig(FairseqDataclass):
    smoothing: float = field(default=0.1, metadata={"help": "label smoothing"})
    sentence_avg: bool = II("optimization.sentence_avg")
    block: int = II("task.tokens_per_sample")


@register_criterion("smoothed_lm", dataclass=SmoothedLMConfig)
class SmoothedLM(FairseqCriterion):
    def __init__(self, task, smoothing, sentence_avg, block):
        super().__init__(task)
        assert (smoothing, sentence_avg, block) == (0.2, False, 32), (smoothing, sentence_avg, block)
        self.eps, self.sentence_avg = smoothing, sentence_avg

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        lprobs = lprobs.view(-1, lprobs.size(-1))
        target = model.get_targets(sample, net_output).view(-1)
        keep = target.ne(self.padding_idx)
        nll = F.nll_loss(lprobs, target, ignore_index=self.padding_idx, reduction="sum")
        smooth = -lprobs.sum(-1)[keep].sum() / lprobs.size(-1)
        loss = (1 - self.eps) * nll + self.eps * smooth
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        return loss, sample_size, {"loss": loss.data, "nll_loss": nll.data, "ntokens": sample["ntokens"],
                                   "nsentences": sample["target"].size(0), "sample_size": sample_size}

    @staticmethod
    def reduce_metrics(logging_outputs):
        loss = utils.item(sum(log.get("loss", 0) for log in logging_outputs))
        nll = utils.item(sum(log.get("nll_loss", 0) for log in logging_outputs))
        ntokens = utils.item(sum(log.get("ntokens", 0) for log in logging_outputs))
        sample_size = utils.item(sum(log.get("sample_size", 0) for log in logging_outputs))
        metrics.log_scalar("loss", loss / sample_size / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", nll / ntokens / math.log(2), ntokens, round=3)
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["nll_loss"].avg))

    @staticmethod
    def logging_outputs_can_be_summed():
        return True


@register_model_architecture("transformer_lm", "my_tiny_lm")
def my_tiny_lm(args):
    args.decoder_layers = getattr(args, "decoder_layers", 2)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 32)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 64)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 2)
    base_lm_architecture(args)
"""


def test_a_plugin_written_for_upstream_trains(tiny_data, tmp_path, user_dir):
    """--user-dir with upstream's imports (fairseq.metrics, fairseq.utils, FairseqCriterion, FairseqDataclass,
    II(...) defaults, model.get_normalized_probs/get_targets, register_model_architecture from fairseq.models)."""
    plugin = user_dir("upstream_plugin", UPSTREAM_STYLE_PLUGIN)
    save = tmp_path / "ck"
    argv = [
        "--task",
        "language_modeling",
        str(tiny_data),
        "--save-dir",
        str(save),
        "--user-dir",
        str(plugin),
        "--arch",
        "my_tiny_lm",
        "--criterion",
        "smoothed_lm",
        "--smoothing",
        "0.2",
        "--optimizer",
        "adam",
        "--lr",
        "0.002",
        "--tokens-per-sample",
        "32",
        "--max-tokens",
        "256",
        "--max-update",
        "3",
        "--cpu",
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--log-file",
        str(save / "train.log"),
        "--num-workers",
        "0",
        "--no-save",
    ]
    status, out, err = train_in_process(argv)  # the plug-in imported in this process, as fairseq-train imports it
    assert status == 0, out[-3000:] + err[-3000:]
    rows = read_json_log(save / "train.log")
    assert len(rows) == 3
    # smoothing spreads 20% of the target mass over the vocabulary: the loss is above the plain NLL
    assert all(float(r["loss"]) > float(r["nll_loss"]) for r in rows)
    assert float(rows[-1]["ppl"]) == pytest.approx(2 ** float(rows[-1]["nll_loss"]), rel=1e-2)


def test_an_index_whose_sizes_disagree_with_its_pointers_is_refused(tiny_data, tmp_path, train_args):
    """One byte of valid.idx changed (item 0's size): the .bin's length still matches, the pointers do not."""
    import shutil

    data = tmp_path / "data-bin"
    shutil.copytree(tiny_data, data)
    with open(data / "valid.idx", "r+b") as f:
        f.seek(26)  # item 0's size, right after the header
        size = f.read(1)[0]
        f.seek(26)
        f.write(bytes([size - 1]))
    status, _, err = train_in_process(train_args(data, tmp_path / "ck", max_update=1))
    assert status == 1
    assert err.strip() == (
        f"fairseq-train: error: {data / 'valid.idx'}: corrupt index: item 0 (pointer 0, size "
        f"{size - 1}) ends at byte {2 * (size - 1)} but item 1's pointer is {2 * size}; "
        "re-run fairseq-preprocess"
    )
