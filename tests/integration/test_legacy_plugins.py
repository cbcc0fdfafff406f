"""Upstream's legacy `--user-dir` plug-ins (components without a dataclass, flags from `add_args(parser)`,
architectures as functions on the namespace) through the real fairseq-train, fairseq-eval-lm and hub entry
points: a tutorial-style LSTM language model, a criterion, a task and a wrapper of this fork's transformer_lm."""

import argparse
import json
import math

import pytest
import torch

from fairseq import options, registry
from fairseq.logging.progress_bar import read_json_log
from fairseq.utils import run_console_script
from fairseq_cli import eval_lm, train

pytestmark = pytest.mark.usefixtures("one_thread")

# Written as upstream's "Simple LSTM" tutorial writes its plug-in (decoder-only here).
PLUGIN = """
import math

import torch.nn.functional as F
from torch import nn

from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion, LegacyFairseqCriterion, register_criterion
from fairseq.models import (FairseqIncrementalDecoder, FairseqLanguageModel, register_model,
                            register_model_architecture)
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture
from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingTask


class LSTMDecoder(FairseqIncrementalDecoder):
    def __init__(self, dictionary, embed_dim, hidden_dim, dropout):
        super().__init__(dictionary)
        self.embed_tokens = nn.Embedding(len(dictionary), embed_dim, padding_idx=dictionary.pad())
        self.dropout = nn.Dropout(dropout)
        self.lstm = nn.LSTM(embed_dim, hidden_dim, batch_first=True)
        self.output_projection = nn.Linear(hidden_dim, len(dictionary))

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None):
        state = None
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
            state = utils.get_incremental_state(self, incremental_state, "hidden")
        x = self.dropout(self.embed_tokens(prev_output_tokens))
        x, (h, c) = self.lstm(x, None if state is None else (state["h"], state["c"]))
        if incremental_state is not None:
            utils.set_incremental_state(self, incremental_state, "hidden", {"h": h, "c": c})
        return self.output_projection(self.dropout(x)), None

    def reorder_incremental_state(self, incremental_state, new_order):
        state = utils.get_incremental_state(self, incremental_state, "hidden")
        if state is not None:
            utils.set_incremental_state(self, incremental_state, "hidden",
                                        {k: v.index_select(1, new_order) for k, v in state.items()})


@register_model("tutorial_lstm_lm")
class TutorialLSTMLanguageModel(FairseqLanguageModel):
    @staticmethod
    def add_args(parser):
        parser.add_argument("--lstm-embed-dim", type=int, metavar="N", help="dimensionality of the embeddings")
        parser.add_argument("--lstm-hidden-dim", type=int, metavar="N", help="dimensionality of the LSTM state")
        parser.add_argument("--lstm-dropout", type=float, default=0.1, help="dropout probability")

    @classmethod
    def build_model(cls, args, task):
        if args.lstm_hidden_dim < 1:
            raise ValueError(f"--lstm-hidden-dim must be at least 1, got {args.lstm_hidden_dim}")
        return cls(LSTMDecoder(task.target_dictionary, args.lstm_embed_dim, args.lstm_hidden_dim,
                               args.lstm_dropout))


@register_model_architecture("tutorial_lstm_lm", "tutorial_lstm_lm")
def tutorial_lstm_lm(args):
    args.lstm_embed_dim = getattr(args, "lstm_embed_dim", 16)
    args.lstm_hidden_dim = getattr(args, "lstm_hidden_dim", 24)


@register_criterion("tutorial_weighted_cross_entropy")
class TutorialWeightedCrossEntropy(FairseqCriterion):
    @staticmethod
    def add_args(parser):
        parser.add_argument("--loss-weight", type=float, default=1.0, help="multiply the loss by this")

    def __init__(self, task, sentence_avg, loss_weight):
        super().__init__(task)
        self.sentence_avg = sentence_avg
        self.loss_weight = loss_weight

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        loss = F.nll_loss(lprobs.view(-1, lprobs.size(-1)), sample["target"].view(-1),
                          ignore_index=self.padding_idx, reduction="sum") * self.loss_weight
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        return loss, sample_size, {"loss": loss.data, "ntokens": sample["ntokens"],
                                   "nsentences": sample["target"].size(0), "sample_size": sample_size}

    @staticmethod
    def reduce_metrics(logging_outputs):
        loss_sum = sum(log.get("loss", 0) for log in logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        metrics.log_scalar("loss", loss_sum / sample_size / math.log(2), sample_size, round=3)

    @staticmethod
    def logging_outputs_can_be_summed():
        return True


@register_criterion("tutorial_legacy_cross_entropy")
class TutorialLegacyCrossEntropy(LegacyFairseqCriterion):
    @staticmethod
    def add_args(parser):
        parser.add_argument("--legacy-loss-weight", type=float, default=1.0)

    def __init__(self, args, task):
        super().__init__(args, task)
        self.sentence_avg, self.loss_weight = args.sentence_avg, args.legacy_loss_weight

    forward = TutorialWeightedCrossEntropy.forward
    reduce_metrics = staticmethod(TutorialWeightedCrossEntropy.reduce_metrics)
    logging_outputs_can_be_summed = staticmethod(TutorialWeightedCrossEntropy.logging_outputs_can_be_summed)


@register_task("tutorial_lm_with_knob")
class TutorialLMWithKnob(LanguageModelingTask):
    @staticmethod
    def add_args(parser):
        LanguageModelingTask.add_args(parser)
        parser.add_argument("--knob", type=int, default=5)

    @classmethod
    def setup_task(cls, args, **kwargs):
        task = super().setup_task(args, **kwargs)
        task.knob = args.knob
        task.hook_calls = []
        cls.last_task = task  # the tests read the hooks' calls of the last run
        return task

    def begin_epoch(self, epoch, model):
        self.hook_calls.append(("begin_epoch", epoch, type(model).__name__))

    def begin_valid_epoch(self, epoch, model):
        self.hook_calls.append(("begin_valid_epoch", epoch, type(model).__name__))


@register_model("tutorial_wrapped_lm")
class TutorialWrappedLM(TransformerLanguageModel):
    @staticmethod
    def add_args(parser):
        TransformerLanguageModel.add_args(parser)
        parser.add_argument("--wrap-note", default="plain")


@register_model_architecture("tutorial_wrapped_lm", "tutorial_wrapped_lm_tiny")
def tutorial_wrapped_lm_tiny(args):
    args.decoder_layers = getattr(args, "decoder_layers", 1)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 16)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 32)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 2)
    base_lm_architecture(args)
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    directory = tmp_path_factory.mktemp("plugins") / "legacy_tutorial_plugin"
    directory.mkdir()
    (directory / "__init__.py").write_text(PLUGIN)
    return str(directory)


def lstm_train_argv(data, save_dir, plugin, *extra, max_update):
    return [
        str(data),
        "--user-dir",
        plugin,
        "--arch",
        "tutorial_lstm_lm",
        "--lstm-hidden-dim",
        "20",
        "--optimizer",
        "adam",
        "--lr",
        "0.01",
        "--max-tokens",
        "256",
        "--tokens-per-sample",
        "32",
        "--sample-break-mode",
        "none",
        "--max-update",
        str(max_update),
        "--seed",
        "3",
        "--cpu",
        "--num-workers",
        "0",
        "--save-dir",
        str(save_dir),
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--log-file",
        str(save_dir / "train.log"),
        *extra,
    ]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def straight_run(tiny_data, plugin, tmp_path_factory):
    """The tutorial LSTM trained 6 updates in one run."""
    save_dir = tmp_path_factory.mktemp("lstm_straight")
    train.cli_main(lstm_train_argv(tiny_data, save_dir, plugin, max_update=6))
    return save_dir


def test_tutorial_model_trains_evaluates_and_resumes(tiny_data, plugin, straight_run, tmp_path):
    save_dir = tmp_path / "resumed"
    train.cli_main(lstm_train_argv(tiny_data, save_dir, plugin, max_update=4))
    saved = load(save_dir / "checkpoint_last.pt")
    model_cfg = saved["cfg"]["model"]
    # The whole namespace, as upstream: the arch function's default, the flag, add_args's declared default.
    assert (model_cfg["_name"], model_cfg["arch"]) == ("tutorial_lstm_lm", "tutorial_lstm_lm")
    assert (model_cfg["lstm_embed_dim"], model_cfg["lstm_hidden_dim"], model_cfg["lstm_dropout"]) == (16, 20, 0.1)
    assert model_cfg["tokens_per_sample"] == 32 and model_cfg["optimizer"] == "adam"
    assert tuple(saved["model"]["decoder.lstm.weight_ih_l0"].shape) == (4 * 20, 16)

    # fairseq-eval-lm rebuilds the model from the checkpoint's config: its loss is training's valid loss.
    valid_loss = float(read_json_log(save_dir / "train.log", tag="valid")[-1]["valid_loss"])
    results = tmp_path / "results"
    eval_lm.cli_main(
        [
            str(tiny_data),
            "--user-dir",
            plugin,
            "--path",
            str(save_dir / "checkpoint_last.pt"),
            "--gen-subset",
            "valid",
            "--tokens-per-sample",
            "32",
            "--max-tokens",
            "256",
            "--cpu",
            "--results-path",
            str(results),
        ]
    )
    evaluated = json.loads((results / "eval_lm.valid.json").read_text())
    assert abs(evaluated["loss"] - valid_loss) < 1e-3  # the log rounds to 3 decimals

    # The hub rebuilds it too, with the checkpoint's weights.
    from fairseq.models import BaseFairseqModel

    hub = BaseFairseqModel.from_pretrained(str(save_dir), "checkpoint_last.pt", str(tiny_data), user_dir=plugin)
    assert type(hub.models[0]).__name__ == "TutorialLSTMLanguageModel"
    for name, value in hub.models[0].state_dict().items():
        assert torch.equal(value, saved["model"][name]), name
    assert len(hub.sample(["w1 w2"], beam=2, max_len_b=3)) == 1  # the plug-in's incremental decoding

    # Resuming to 6 updates continues the same run as training 6 updates at once.
    train.cli_main(lstm_train_argv(tiny_data, save_dir, plugin, max_update=6))
    resumed = [(r["num_updates"], r["loss"]) for r in read_json_log(save_dir / "train.log")]
    straight = [(r["num_updates"], r["loss"]) for r in read_json_log(straight_run / "train.log")]
    assert resumed == straight and [u for u, _ in straight] == [str(i) for i in range(1, 7)]
    a, b = load(straight_run / "checkpoint_last.pt")["model"], load(save_dir / "checkpoint_last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_parse_args_and_arch_returns_upstreams_namespace(plugin):
    args = options.parse_args_and_arch(
        options.get_training_parser(),
        [
            "data-bin",
            "--user-dir",
            plugin,
            "--arch",
            "tutorial_lstm_lm",
            "--lstm-embed-dim",
            "8",
            "--optimizer",
            "adam",
            "--lr",
            "0.01",
        ],
    )
    assert isinstance(args, argparse.Namespace)
    # The flag overrides the arch function's default; the unset flag gets the arch default; the declared default.
    assert (args.lstm_embed_dim, args.lstm_hidden_dim, args.lstm_dropout) == (8, 24, 0.1)
    assert (args.arch, args.task, args.criterion, args.optimizer, args.lr, args.data) == (
        "tutorial_lstm_lm",
        "language_modeling",
        "cross_entropy",
        "adam",
        [0.01],
        "data-bin",
    )
    cfg = options.convert_namespace_to_config(args)
    assert isinstance(cfg.model, argparse.Namespace) and cfg.model._name == "tutorial_lstm_lm"
    assert (cfg.model.lstm_embed_dim, cfg.model.lstm_hidden_dim, cfg.model.data) == (8, 24, "data-bin")
    given = options.parse_args_and_arch(
        options.get_training_parser(),
        ["data-bin", "--user-dir", plugin, "--arch", "tutorial_lstm_lm", "--lstm-hidden-dim", "7"],
        suppress_defaults=True,
    )
    assert given.lstm_hidden_dim == 7 and not hasattr(given, "lstm_embed_dim")


def test_help_lists_the_plugins_flags_and_bad_flags_are_usage_errors(plugin, capsys):
    with pytest.raises(SystemExit) as e:
        train.cli_main(
            [
                "--user-dir",
                plugin,
                "--arch",
                "tutorial_lstm_lm",
                "--criterion",
                "tutorial_weighted_cross_entropy",
                "--help",
            ]
        )
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--lstm-embed-dim", "--lstm-hidden-dim", "--lstm-dropout", "--loss-weight"):
        assert flag in out
    for bad, message in (
        (["--lstm-hiden-dim", "3"], "unrecognized arguments: --lstm-hiden-dim 3"),
        (["--lstm-hidden-dim", "abc"], "argument --lstm-hidden-dim: invalid int value: 'abc'"),
    ):
        with pytest.raises(SystemExit) as e:
            options.parse_args_and_arch(
                options.get_training_parser(), ["data-bin", "--user-dir", plugin, "--arch", "tutorial_lstm_lm", *bad]
            )
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_plugins_value_error_is_one_line(tiny_data, plugin, tmp_path, capsys):
    argv = lstm_train_argv(tiny_data, tmp_path, plugin, "--lstm-hidden-dim", "0", max_update=1)
    with pytest.raises(SystemExit) as e:
        run_console_script("fairseq-train", train.cli_main, argv)
    assert e.value.code == 1
    assert (
        capsys.readouterr().err.strip().splitlines()[-1]
        == "fairseq-train: error: --lstm-hidden-dim must be at least 1, got 0"
    )


@pytest.mark.parametrize(
    "criterion, weight_flag",
    [
        ("tutorial_weighted_cross_entropy", "--loss-weight"),  # FairseqCriterion: __init__ arguments by name
        ("tutorial_legacy_cross_entropy", "--legacy-loss-weight"),  # LegacyFairseqCriterion: __init__(args, task)
    ],
)
def test_legacy_criterion_gets_its_flags(tiny_data, plugin, straight_run, tmp_path, criterion, weight_flag):
    train.cli_main(
        lstm_train_argv(
            tiny_data,
            tmp_path,
            plugin,
            "--criterion",
            criterion,
            weight_flag,
            "2",
            "--disable-validation",
            max_update=1,
        )
    )
    first = read_json_log(tmp_path / "train.log")[0]
    reference = read_json_log(straight_run / "train.log")[0]  # cross_entropy, same seed and batch
    assert abs(float(first["loss"]) - 2 * float(reference["loss"])) <= 2e-3  # both logs round to 3 decimals
    saved = load(tmp_path / "checkpoint_last.pt")["cfg"]["criterion"]
    assert saved[weight_flag[2:].replace("-", "_")] == 2.0 and saved["_name"] == criterion


def test_legacy_task_and_a_wrapper_of_transformer_lm(tiny_data, plugin):
    args = options.parse_args_and_arch(
        options.get_training_parser(),
        [
            str(tiny_data),
            "--user-dir",
            plugin,
            "--task",
            "tutorial_lm_with_knob",
            "--knob",
            "7",
            "--arch",
            "tutorial_wrapped_lm_tiny",
            "--decoder-layers",
            "2",
            "--tokens-per-sample",
            "32",
        ],
    )
    cfg = options.convert_namespace_to_config(args)
    task = registry.TASK_REGISTRY.get("tutorial_lm_with_knob").setup_task(cfg.task)
    assert task.knob == 7 and isinstance(cfg.task, argparse.Namespace)
    model = task.build_model(cfg.model)
    assert type(model).__name__ == "TutorialWrappedLM" and len(model.decoder.layers) == 2
    assert (cfg.model.decoder_embed_dim, cfg.model.wrap_note) == (16, "plain")
    assert cfg.model.activation_dropout == 0.0  # no preset sets it: transformer_lm's default
    assert cfg.model.max_target_positions == 32  # filled from --tokens-per-sample when built, as upstream
    with torch.no_grad():
        logits, _ = model(torch.tensor([[2, 5, 6, 7]]))
    assert logits.shape == (1, 4, len(task.target_dictionary)) and math.isfinite(float(logits.sum()))


def test_the_trainer_calls_a_tasks_epoch_hooks_as_upstream_does(tiny_data, plugin, tmp_path):
    """FairseqTask.begin_epoch(epoch, model) at each epoch's start, begin_valid_epoch before each validation."""
    train.cli_main(
        [
            str(tiny_data),
            "--user-dir",
            plugin,
            "--task",
            "tutorial_lm_with_knob",
            "--arch",
            "tutorial_wrapped_lm_tiny",
            "--tokens-per-sample",
            "32",
            "--optimizer",
            "adam",
            "--lr",
            "1e-3",
            "--max-tokens",
            "256",
            "--max-epoch",
            "2",
            "--cpu",
            "--num-workers",
            "0",
            "--save-dir",
            str(tmp_path),
            "--no-save",
            "--log-format",
            "json",
        ]
    )
    calls = registry.TASK_REGISTRY.get("tutorial_lm_with_knob").last_task.hook_calls
    assert calls == [
        ("begin_epoch", 1, "TutorialWrappedLM"),
        ("begin_valid_epoch", 1, "TutorialWrappedLM"),
        ("begin_epoch", 2, "TutorialWrappedLM"),
        ("begin_valid_epoch", 2, "TutorialWrappedLM"),
    ]


LEGACY_YAML = {
    "task": {"_name": "tutorial_lm_with_knob", "data": "DATA", "knob": "7", "tokens_per_sample": 32},
    "model": {"_name": "tutorial_lstm_lm", "lstm_hidden_dim": 20, "lstm_dropout": 0.25},
    "criterion": {"_name": "tutorial_weighted_cross_entropy", "loss_weight": 2},
    "optimizer": "adam",
}


def test_yaml_sets_a_legacy_plugins_options_as_its_flags_would(plugin, tiny_data):
    """A config (fairseq-hydra-train's input) names the keys of a legacy component by its flags' dests; the
    result is the command line's config (values typed as the flags' `type`: "7" -> 7, 2 -> 2.0)."""
    from fairseq.frontend.hydra import fairseq_config_from_dict

    values = {**LEGACY_YAML, "task": dict(LEGACY_YAML["task"], data=str(tiny_data)), "common": {"user_dir": plugin}}
    from_yaml = fairseq_config_from_dict(values)
    from_flags = options.convert_namespace_to_config(
        options.parse_args_and_arch(
            options.get_training_parser(),
            [
                str(tiny_data),
                "--user-dir",
                plugin,
                "--task",
                "tutorial_lm_with_knob",
                "--knob",
                "7",
                "--tokens-per-sample",
                "32",
                "--arch",
                "tutorial_lstm_lm",
                "--lstm-hidden-dim",
                "20",
                "--lstm-dropout",
                "0.25",
                "--criterion",
                "tutorial_weighted_cross_entropy",
                "--loss-weight",
                "2",
                "--optimizer",
                "adam",
            ],
        )
    )
    assert (from_yaml.task.knob, from_yaml.model.lstm_hidden_dim, from_yaml.model.lstm_dropout) == (7, 20, 0.25)
    assert from_yaml.model.lstm_embed_dim == 16  # the architecture function filled it
    assert from_yaml.criterion.loss_weight == 2.0 and isinstance(from_yaml.criterion.loss_weight, float)
    for component in ("task", "model", "criterion"):  # argparse's namespace also holds its own `_groups`
        yaml_values, flag_values = vars(getattr(from_yaml, component)), vars(getattr(from_flags, component))
        flag_values.pop("_groups")
        assert yaml_values == flag_values, component


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "lstm_hiden_dim",
            8,
            r"^unknown key 'model.lstm_hiden_dim' \(did you mean 'model.lstm_hidden_dim'\?\): "
            r"model 'tutorial_lstm_lm' is a legacy plug-in whose add_args declares lstm_dropout, "
            r"lstm_embed_dim, lstm_hidden_dim$",
        ),
        ("lstm_hidden_dim", "eight", r"^model.lstm_hidden_dim='eight': not a valid value for --lstm-hidden-dim"),
        ("lstm_hidden_dim", 8.5, r"^model.lstm_hidden_dim=8.5: --lstm-hidden-dim takes an integer$"),
        ("lstm_dropout", True, r"^model.lstm_dropout=True: --lstm-dropout takes a number$"),
    ],
)
def test_yaml_errors_for_a_legacy_plugin_name_the_key(plugin, key, value, message):
    from fairseq.frontend.hydra import fairseq_config_from_dict

    with pytest.raises(ValueError, match=message):
        fairseq_config_from_dict(
            {
                "task": {"_name": "dummy_lm"},
                "optimizer": "adam",
                "common": {"user_dir": plugin},
                "model": {"_name": "tutorial_lstm_lm", key: value},
            }
        )


def test_hydra_train_trains_a_legacy_plugin(plugin, tiny_data, tmp_path, monkeypatch):
    """fairseq-hydra-train on a YAML file that configures the plug-in's model, task and criterion."""
    import yaml

    from fairseq_cli import hydra_train

    config = {
        **LEGACY_YAML,
        "task": dict(LEGACY_YAML["task"], data=str(tiny_data), sample_break_mode="none"),
        "common": {"user_dir": plugin, "cpu": True, "seed": 3, "log_format": "json", "log_interval": 1},
        "optimizer": {"_name": "adam"},
        "optimization": {"lr": [0.01], "max_update": 2},
        "dataset": {"max_tokens": 256, "num_workers": 0},
        "checkpoint": {"save_dir": str(tmp_path / "ck")},
    }
    (tmp_path / "legacy.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    hydra_train.cli_main(
        [
            "--config-dir",
            str(tmp_path),
            "--config-name",
            "legacy",
            "hydra.run.dir=run",
            "hydra/job_logging=none",
            "model.lstm_hidden_dim=12",
        ]
    )
    state = load(tmp_path / "ck" / "checkpoint_last.pt")
    assert state["extra_state"]["trainer"]["num_updates"] == 2
    saved = state["cfg"]
    assert (saved["model"]["lstm_hidden_dim"], saved["task"]["knob"], saved["criterion"]["loss_weight"]) == (12, 7, 2.0)
    assert state["model"]["decoder.lstm.weight_hh_l0"].shape == (4 * 12, 12)
