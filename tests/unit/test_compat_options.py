"""Upstream options accepted for compatibility: each notice of fairseq.dataclass.notices.COMPAT_NOTICES comes
from a real parsed command line, and the options this fork implements for upstream's entry points
(--num-shards/--shard-id in fairseq-eval-lm, --fixed-validation-seed, --optimizer-overrides on resume,
--dataset-impl) behave as upstream's."""

import pytest

from fairseq import options
from fairseq.dataclass.notices import COMPAT_NOTICES, compat_notices
from fairseq.frontend.validate import validate
from tests.train_fixtures import default_train_argv, train_in_process

TRAIN_BASE = [
    "data",
    "--task",
    "language_modeling",
    "--arch",
    "transformer_lm",
    "--optimizer",
    "adam",
    "--max-tokens",
    "64",
    "--tokens-per-sample",
    "64",
]
# A non-default value for each noticed option (the flag alone for a boolean one).
SET = {
    "min_params_to_wrap": ["--min-params-to-wrap", "1000"],
    "softmax_batch": ["--softmax-batch", "1024"],
    "retain_dropout_modules": ["--retain-dropout-modules", "TransformerDecoderLayer"],
    "thresholdtgt": ["--thresholdtgt", "2"],
    "nwordstgt": ["--nwordstgt", "5"],
    "tgtdict": ["--tgtdict", "d.txt"],
}
# The eval-lm and generation groups' flags are on their tools' parsers (given a data directory and --path).
PARSERS = {"eval_lm": options.get_eval_lm_parser, "generation": options.get_generation_parser}
EVAL_BASE = ["data", "--task", "language_modeling", "--path", "model.pt", "--max-tokens", "64"]


def _config(group, argv):
    if group == "preprocess":  # fairseq-preprocess's namespace, as it announces it (its own group only)
        from types import SimpleNamespace

        from fairseq.dataclass.configs import PreprocessConfig
        from fairseq.dataclass.utils import config_from_namespace

        args = options.get_preprocessing_parser().parse_args(["--only-source", *argv[len(TRAIN_BASE) :]])
        return SimpleNamespace(preprocess=config_from_namespace(PreprocessConfig, args))
    parser = PARSERS.get(group, options.get_training_parser)()
    if group in PARSERS:
        argv = EVAL_BASE + argv[len(TRAIN_BASE) :]
    args = options.parse_args_and_arch(parser, argv)
    if group == "generation":  # as fairseq-generate builds its config
        return options.convert_namespace_to_generation_config(args)
    return options.convert_namespace_to_config(args)


@pytest.mark.parametrize("group,name,instead", COMPAT_NOTICES, ids=[n for _, n, _ in COMPAT_NOTICES])
def test_each_noticed_option_set_on_the_command_line_gives_its_one_line(group, name, instead):
    flag = SET.get(name, ["--" + name.replace("_", "-")])
    assert compat_notices(**vars(_config(group, TRAIN_BASE))) == []
    value = "" if len(flag) == 1 else f" {flag[1]}"
    assert compat_notices(**vars(_config(group, TRAIN_BASE + flag))) == [
        f"{flag[0]}{value} is accepted for upstream compatibility: {instead}"
    ]


def test_notices_are_logged_once_at_training_start(tiny_data, tmp_path):
    argv = default_train_argv(
        tiny_data,
        tmp_path,
        "--min-params-to-wrap",
        "1000",
        "--fix-batches-to-gpus",
        "--write-checkpoints-asynchronously",
        max_update=1,
    )
    status, out, err = train_in_process(argv)
    assert status == 0, err
    notices = [line for line in out.splitlines() if "accepted for upstream compatibility" in line]
    assert len(notices) == 2 and "--min-params-to-wrap 1000" in notices[1], notices
    assert "| INFO |" in notices[0] and "--fix-batches-to-gpus" in notices[0]


def test_dataset_impl_other_than_mmap_is_refused_at_start():
    validate(_config("train", TRAIN_BASE + ["--dataset-impl", "mmap"]))
    with pytest.raises(ValueError, match=r"--dataset-impl 'lazy' is not supported: only 'mmap'"):
        validate(_config("train", TRAIN_BASE + ["--dataset-impl", "lazy"]))


def test_bad_optimizer_overrides_fail_at_start():
    with pytest.raises(ValueError, match=r"--optimizer-overrides '\[1\]': expected a Python dict literal"):
        validate(_config("train", TRAIN_BASE + ["--optimizer-overrides", "[1]"]))
    # the scheduler would set lr again at the next update: refused, not silently lost
    with pytest.raises(
        ValueError,
        match=r"'lr' would be replaced by the learning-rate scheduler .* --lr and "
        r"--reset-lr-scheduler",
    ):
        validate(_config("train", TRAIN_BASE + ["--optimizer-overrides", "{'lr': 0.5}"]))


def test_misspelt_optimizer_override_is_refused_at_start(tiny_data, tmp_path):
    status, _, err = train_in_process(
        default_train_argv(tiny_data, tmp_path, "--optimizer-overrides", "{'weight_dacay': 0.5}", max_update=3)
    )
    assert status == 2 and err.splitlines()[-1].split(": error: ", 1)[1:] == [
        "--optimizer-overrides 'weight_dacay': not an option of --optimizer adam (AdamW) "
        "(did you mean 'weight_decay'?); its options are amsgrad, betas, capturable, decoupled_weight_decay, "
        "differentiable, eps, foreach, fused, lr, maximize, weight_decay"
    ]
    assert not (tmp_path / "checkpoint_last.pt").exists()


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "{'eps': -1.0}",
            "--optimizer-overrides {'eps': -1.0} is refused by --optimizer adam (AdamW) (ValueError: "
            "Invalid epsilon value: -1.0); eps takes a number >= 0, e.g. 1e-08",
        ),
        (
            "{'betas': 3}",
            "--optimizer-overrides {'betas': 3} is refused by --optimizer adam (AdamW) (TypeError: 'int' "
            "object is not subscriptable); betas takes a pair of numbers in [0, 1), e.g. (0.9, 0.98)",
        ),
        (
            "{'betas': (0.9, 0.98, 0.5)}",
            "--optimizer-overrides {'betas': (0.9, 0.98, 0.5)} is refused by --optimizer "
            "adam (AdamW) (ValueError: too many values to unpack (expected 2)); betas takes "
            "a pair of numbers in [0, 1), e.g. (0.9, 0.98)",
        ),
        # 1e999 is inf: accepted by torch's checks, then NaN (weight_decay) or no learning at all (eps)
        (
            "{'weight_decay': 1e999}",
            "--optimizer-overrides {'weight_decay': inf}: not a finite number; weight_decay "
            "takes a number >= 0, e.g. 0.01",
        ),
        (
            "{'eps': 1e999}",
            "--optimizer-overrides {'eps': inf}: not a finite number; eps takes a number >= 0, e.g. 1e-08",
        ),
        (
            "{'betas': (0.9, -1e999)}",
            "--optimizer-overrides {'betas': (0.9, -inf)}: not a finite number; betas takes a "
            "pair of numbers in [0, 1), e.g. (0.9, 0.98)",
        ),
    ],
)
def test_bad_optimizer_override_values_are_refused_at_start(tiny_data, tmp_path, override, message):
    """Checked by the optimizer's own code (its constructor, one step) before training, not saved into
    checkpoints (eps) or failing at the first update (betas)."""
    status, _, err = train_in_process(default_train_argv(tiny_data, tmp_path, "--optimizer-overrides", override))
    assert status == 2 and err.splitlines()[-1].split(": error: ", 1)[1:] == [message]  # a usage error
    assert not (tmp_path / "checkpoint_last.pt").exists()


def test_optimizer_override_whose_step_gives_infinite_parameters_is_refused_at_start(tiny_data, tmp_path):
    """A finite value can still overflow: with this --lr, one AdamW step's decay factor 1 - lr * 1e10 is -inf."""
    argv = default_train_argv(tiny_data, tmp_path, "--lr", "1e300", "--optimizer-overrides", "{'weight_decay': 1e10}")
    status, _, err = train_in_process(argv)
    assert status == 2 and err.splitlines()[-1].split(": error: ", 1)[1:] == [
        "--optimizer-overrides {'weight_decay': 10000000000.0} is refused by --optimizer adam (AdamW) (ValueError: "
        "one step with it makes the parameters [-inf, -inf]); weight_decay takes a number >= 0, e.g. 0.01"
    ]
    assert not (tmp_path / "checkpoint_last.pt").exists()


def test_optimizer_overrides_are_set_in_the_resumed_optimizer(tiny_data, tmp_path):
    from fairseq.checkpoint.io import load_checkpoint_file

    assert train_in_process(default_train_argv(tiny_data, tmp_path, max_update=2))[0] == 0
    first = load_checkpoint_file(str(tmp_path / "checkpoint_last.pt"))["last_optimizer_state"]["param_groups"]
    assert [g["weight_decay"] for g in first] == [0.01] * len(first)  # TRAIN_RECIPE's --weight-decay
    status, _, err = train_in_process(
        default_train_argv(tiny_data, tmp_path, "--optimizer-overrides", "{'weight_decay': 0.5}", max_update=3)
    )
    assert status == 0, err
    resumed = load_checkpoint_file(str(tmp_path / "checkpoint_last.pt"))["last_optimizer_state"]["param_groups"]
    assert [g["weight_decay"] for g in resumed] == [0.5] * len(resumed)


def test_fixed_validation_seed_seeds_each_validation(tiny_data, tmp_path, user_dir):
    # A criterion that records one random draw per validation batch (the model is in eval mode there).
    plugin = user_dir(
        "seed_probe",
        f"""
import torch
from fairseq.registry import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig


@register_criterion("seed_probe", dataclass=CrossEntropyCriterionConfig)
class SeedProbe(CrossEntropyCriterion):
    def forward(self, model, sample, reduce=True):
        if not model.training:
            with open({str(tmp_path / "draws.txt")!r}, "a") as f:
                f.write(f"{{torch.randint(1 << 30, ()).item()}}\\n")
        return super().forward(model, sample, reduce)
""",
    )
    draws_file = tmp_path / "draws.txt"

    def validation_draws(*flags):
        draws_file.unlink(missing_ok=True)
        argv = default_train_argv(
            tiny_data,
            tmp_path / "ck",
            "--user-dir",
            str(plugin),
            "--criterion",
            "seed_probe",
            "--validate-interval-updates",
            "1",
            "--max-valid-steps",
            "1",
            "--no-save",
            *flags,
            max_update=3,
        )
        status, _, err = train_in_process(argv)
        assert status == 0, err
        return [int(x) for x in draws_file.read_text().split()]

    fixed = validation_draws("--fixed-validation-seed", "1234")
    assert len(fixed) == 3 and len(set(fixed)) == 1, fixed  # every validation starts from the same state
    assert validation_draws("--fixed-validation-seed", "1234", "--seed", "4") == fixed  # whatever --seed is
    unfixed = validation_draws()
    assert len(set(unfixed)) == 3, unfixed  # without it: the state the last update left


def _eval_lm(checkpoint, data, *extra):
    from fairseq_cli import eval_lm

    parser = options.get_eval_lm_parser()
    args = options.parse_args_and_arch(
        parser,
        [str(data), "--path", str(checkpoint), "--cpu", "--batch-size", "4", "--tokens-per-sample", "32", *extra],
    )
    return eval_lm.main(args)


def test_eval_lm_num_shards_splits_the_tokens_between_shards(tiny_lm_checkpoint, tiny_data):
    whole = _eval_lm(tiny_lm_checkpoint, tiny_data)
    shards = [_eval_lm(tiny_lm_checkpoint, tiny_data, "--num-shards", "3", "--shard-id", str(i)) for i in range(3)]
    assert sum(s["tokens"] for s in shards) == whole["tokens"]
    assert all(0 < s["tokens"] < whole["tokens"] for s in shards)
    # Per-token losses weighted by token counts give the whole split's (batches are the same, only dealt out).
    combined = sum(s["loss"] * s["tokens"] for s in shards) / whole["tokens"]
    assert combined == pytest.approx(whole["loss"], rel=1e-6)


def test_eval_lm_shard_id_out_of_range_is_one_clear_error(tiny_lm_checkpoint, tiny_data):
    with pytest.raises(ValueError, match=r"--shard-id 2 must lie in \[0, --num-shards 2\)"):
        _eval_lm(tiny_lm_checkpoint, tiny_data, "--num-shards", "2", "--shard-id", "2")
