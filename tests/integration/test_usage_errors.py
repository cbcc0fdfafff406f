"""Usage errors and --help of the entry points built from fairseq.options: a misspelt flag or choice is one
`PROG: error:` line with the closest real one (not ~100 lines of usage first), and the tools that read a
trained model list in --help only the flags they read (training flags still parse)."""

import pytest

from fairseq_cli import eval_lm, generate, interactive, preprocess, train, validate
from tests.train_fixtures import console_in_process, default_train_argv, train_in_process

pytestmark = pytest.mark.usefixtures("one_thread")

ENTRY_POINTS = {
    "fairseq-train": train.cli_main,
    "fairseq-eval-lm": eval_lm.cli_main,
    "fairseq-generate": generate.cli_main,
    "fairseq-interactive": interactive.cli_main,
    "fairseq-validate": validate.cli_main,
    "fairseq-preprocess": preprocess.cli_main,
}


def one_error_line(name, argv):
    """The message of the single stderr line of `name ARGV`, which must exit 2 (a usage error)."""
    status, _, err = console_in_process(name, ENTRY_POINTS[name], [str(a) for a in argv])
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    return lines[0].split(": error: ", 1)[1]


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_misspelt_flag_is_one_line_with_the_closest_flag(name, tmp_path):
    message = one_error_line(
        name,
        [tmp_path, "--max-tokenz", 10] if name != "fairseq-preprocess" else ["--trainprefix", tmp_path / "train.txt"],
    )
    wanted = "--max-tokens" if name != "fairseq-preprocess" else "--trainpref"
    assert message.startswith("unrecognized arguments: --") and f"(did you mean {wanted}?)" in message


def test_two_misspelt_flags_and_a_prefix(tmp_path):
    assert one_error_line("fairseq-train", [tmp_path, "--lr-shceduler", "cosine", "--max-tokenz", 10]) == (
        "unrecognized arguments: --lr-shceduler cosine --max-tokenz 10 "
        "(did you mean --lr-scheduler for --lr-shceduler, --max-tokens for --max-tokenz?)"
    )
    # argparse's abbreviations stay off (allow_abbrev=False): a prefix of a flag is refused, with the flag
    assert one_error_line("fairseq-train", [tmp_path, "--max-tok", 10]) == (
        "unrecognized arguments: --max-tok 10 (did you mean --max-tokens?)"
    )
    message = one_error_line("fairseq-generate", [tmp_path, "--zzzz", 1])
    assert message.startswith("unrecognized arguments: --zzzz 1; `") and message.endswith(" --help` lists the options")


@pytest.mark.parametrize(
    "flag, value, suggestion",
    [
        ("--arch", "transformer_lmm", "transformer_lm"),
        ("--optimizer", "adamm", "adam"),
        ("--lr-scheduler", "inverse_sqrtt", "inverse_sqrt"),
        ("--criterion", "cross_entropyy", "cross_entropy"),
        ("--task", "language_modelling", "language_modeling"),
        ("--bpe", "gpt", "gpt2"),
        ("--ddp-backend", "fully_shardd", "fully_sharded"),
        ("--log-format", "jsn", "json"),
    ],
)
def test_misspelt_choice_is_one_line_with_the_closest_choice(tmp_path, flag, value, suggestion):
    message = one_error_line("fairseq-train", [tmp_path, "--arch", "transformer_lm", flag, value])
    assert f"{value!r}" in message and flag in message and f"(did you mean {suggestion!r}?)" in message


def test_generation_choice_and_value_errors_are_one_line(tmp_path):
    assert "(did you mean 'gpt2'?)" in one_error_line("fairseq-generate", [tmp_path, "--bpe", "gtp2"])
    assert "(did you mean 'gpt2'?)" in one_error_line("fairseq-interactive", [tmp_path, "--bpe", "gpt22"])
    assert one_error_line("fairseq-generate", [tmp_path, "--sampling", "--sampling-topk", -5]).startswith(
        "--sampling-topk -5"
    )


def test_config_check_error_keeps_its_line_and_status(tiny_data, tmp_path):
    """validate(cfg)'s errors go through the parser's error(): one line, status 2, as before."""
    status, _, err = train_in_process(
        default_train_argv(tiny_data, tmp_path, "--optimizer-overrides", "{'weight_dacay': 0.5}", max_update=3)
    )
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert "--optimizer-overrides 'weight_dacay': not an option of --optimizer adam" in err


def help_text(name):
    status, out, _ = console_in_process(name, ENTRY_POINTS[name], ["--help"])
    assert status == 0
    return out


TRAINING_ONLY = (
    "--lr-scheduler",
    "--optimizer",
    "--lr ",
    "--fsdp-sync-free",
    "--save-interval-updates",
    "--save-dir",
    "--ddp-backend",
    "--max-update",
    "--ema-decay",
    "--tensorboard-logdir",
    "--train-subset",
    "--update-freq",
    "--warmup-updates",
    "--force-anneal",
    "--adam-betas",
)


@pytest.mark.parametrize(
    "name, shown, most_lines",
    [
        (
            "fairseq-generate",
            (
                "--beam",
                "--sampling-topk",
                "--text-only",
                "--path",
                "--results-path",
                "--remove-bpe",
                "--gen-subset",
                "--max-tokens",
                "--bpe",
                "--tokens-per-sample",
                "--seed",
            ),
            250,
        ),
        (
            "fairseq-interactive",
            ("--beam", "--sampling-topp", "--input", "--buffer-size", "--path", "--remove-bpe", "--bpe"),
            250,
        ),
        (
            "fairseq-eval-lm",
            (
                "--path",
                "--context-window",
                "--output-word-probs",
                "--remove-bpe",
                "--results-path",
                "--gen-subset",
                "--max-tokens",
            ),
            150,
        ),
        ("fairseq-validate", ("--path", "--valid-subset", "--criterion", "--max-tokens", "--checkpoint-suffix"), 150),
    ],
)
def test_help_lists_what_the_tool_reads(name, shown, most_lines):
    text = help_text(name)
    assert len(text.splitlines()) <= most_lines  # 455 to 542 lines before, mostly training flags
    assert [flag for flag in shown if flag not in text] == []
    assert [flag for flag in TRAINING_ONLY if flag in text] == []


def test_training_flags_still_parse_in_generate(tiny_data, tiny_lm_checkpoint):
    """Upstream command lines pass training flags to fairseq-generate: accepted (hidden from --help only)."""
    argv = [
        tiny_data,
        "--path",
        tiny_lm_checkpoint,
        "--cpu",
        "--gen-subset",
        "test",
        "--tokens-per-sample",
        32,
        "--sample-break-mode",
        "eos",
        "--batch-size",
        40,
        "--num-workers",
        0,
        "--prefix-size",
        2,
        "--save-interval-updates",
        100,
        "--fsdp-sync-free",
        "--ddp-backend",
        "fully_sharded",
        "--save-dir",
        "elsewhere",
        "--no-progress-bar",
        "--log-format",
        "simple",
    ]
    status, out, err = console_in_process("fairseq-generate", generate.cli_main, [str(a) for a in argv])
    assert status == 0, err
    assert any(line.startswith("H-") for line in out.splitlines())


def test_help_says_what_results_path_and_remove_bpe_do_in_each_tool():
    generate_help, eval_help = (" ".join(help_text(name).split()) for name in ("fairseq-generate", "fairseq-eval-lm"))
    for text in (generate_help, eval_help):
        assert "DIR/generate-SPLIT.txt instead of stdout" in text and "DIR/eval_lm.SPLIT.json" in text
        assert "--post-process [POST_PROCESS], --remove-bpe [POST_PROCESS] undo the BPE" in text
        assert "fairseq-generate and fairseq-interactive join the pieces of the S, T and H lines" in text
        assert "fairseq-eval-lm reports loss and perplexity per word instead of per token" in text
