"""One positions rule for fairseq-eval-lm and fairseq-generate (fairseq/data/block_positions.py): a block longer
than the model's trained positions (32 for the tiny model) is refused in one line naming the flag that made it
and the fix, or skipped with --skip-invalid-size-inputs-valid-test; fairseq-generate's --prefix-size prompts
read only the first N tokens of a sample, so long lines fit. Real CLI in this process, on a split with one
41-token line (sample 2)."""

import re

import pytest

from fairseq_cli import eval_lm, generate, preprocess, validate
from tests.train_fixtures import console_in_process

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "the model's 32 positions (the --tokens-per-sample / --max-target-positions it was trained with)"


@pytest.fixture(scope="module")
def long_line_data(tiny_data, tmp_path_factory):
    """tiny_data's dictionary, a 'test' split of 5 lines whose third is 40 words (41 tokens with </s>)."""
    root = tmp_path_factory.mktemp("long_line")
    lines = ["w1 w2 w3", "w4 w5", " ".join(["w1"] * 40), "w2 w3 w4 w5", "w6 w1"]
    (root / "test.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    dest = root / "data-bin"
    preprocess.cli_main(
        [
            "--only-source",
            "--testpref",
            str(root / "test.txt"),
            "--destdir",
            str(dest),
            "--srcdict",
            str(tiny_data / "dict.txt"),
            "--workers",
            "1",
        ]
    )
    return dest


def eval_lm_run(data, ckpt, *extra):
    return console_in_process(
        "fairseq-eval-lm",
        eval_lm.cli_main,
        [str(data), "--path", str(ckpt), "--gen-subset", "test", "--cpu", "--num-workers", "0", *map(str, extra)],
    )


def generate_run(data, ckpt, *extra):
    return console_in_process(
        "fairseq-generate",
        generate.cli_main,
        [
            str(data),
            "--task",
            "language_modeling",
            "--path",
            str(ckpt),
            "--cpu",
            "--gen-subset",
            "test",
            "--num-workers",
            "0",
            "--beam",
            "1",
            "--max-len-b",
            "40",
            *map(str, extra),
        ],
    )


def validate_run(data, ckpt, *extra):
    return console_in_process(
        "fairseq-validate",
        validate.cli_main,
        [
            str(data),
            "--task",
            "language_modeling",
            "--path",
            str(ckpt),
            "--cpu",
            "--valid-subset",
            "test",
            "--num-workers",
            "0",
            "--max-tokens",
            "4096",
            *map(str, extra),
        ],
    )


def ids(stdout, kind="H"):
    return sorted({int(m.group(1)) for m in re.finditer(rf"^{kind}-(\d+)\t", stdout, re.M)})


def test_eval_lm_refuses_blocks_longer_than_the_model(tiny_data, tiny_lm_checkpoint):
    status, out, _ = eval_lm_run(tiny_data, tiny_lm_checkpoint, "--tokens-per-sample", 32)
    assert status == 0 and "Perplexity" in out  # the trained size
    status, _, err = eval_lm_run(tiny_data, tiny_lm_checkpoint, "--tokens-per-sample", 64)
    assert status == 1 and err.strip() == (
        f"fairseq-eval-lm: error: --tokens-per-sample 64 is more than {MODEL}: "
        "sample 0 of 'test' has 64 tokens; pass --tokens-per-sample 32 or less"
    )
    status, _, err = eval_lm_run(tiny_data, tiny_lm_checkpoint, "--tokens-per-sample", 48, "--context-window", 24)
    assert status == 1 and err.strip() == (
        "fairseq-eval-lm: error: --tokens-per-sample 48 (blocks of 24 tokens read after up to --context-window 24 "
        f"tokens of context) is more than {MODEL}: sample 0 of 'test' has 24 tokens; pass --tokens-per-sample 32 "
        "or less, with a --context-window "
        "smaller than it"
    )
    status, out, _ = eval_lm_run(tiny_data, tiny_lm_checkpoint, "--tokens-per-sample", 32, "--context-window", 16)
    assert status == 0 and "Perplexity" in out


def test_eval_lm_long_line_in_eos_mode(long_line_data, tiny_lm_checkpoint):
    status, _, err = eval_lm_run(
        long_line_data, tiny_lm_checkpoint, "--sample-break-mode", "eos", "--tokens-per-sample", 32
    )
    assert status == 1 and err.strip() == (
        "fairseq-eval-lm: error: sample 2 of 'test' is one line of 41 tokens (--sample-break-mode eos keeps lines "
        f"whole), more than {MODEL}: pass --sample-break-mode none to cut the text into blocks of "
        "--tokens-per-sample 32 or less, or --skip-invalid-size-inputs-valid-test to skip such lines"
    )
    # the fix it names works; the skip flag scores the other lines (4 + 3 + 5 + 3 tokens; all 56 in blocks)
    status, out, _ = eval_lm_run(
        long_line_data, tiny_lm_checkpoint, "--sample-break-mode", "none", "--tokens-per-sample", 32
    )
    assert status == 0 and "Evaluated 56 tokens" in out
    status, out, _ = eval_lm_run(
        long_line_data, tiny_lm_checkpoint, "--sample-break-mode", "eos", "--skip-invalid-size-inputs-valid-test"
    )
    assert status == 0 and "Evaluated 15 tokens" in out and "e.g. [2]" in out


def test_generate_names_the_long_line_and_the_fixes_that_work(long_line_data, tiny_lm_checkpoint):
    eos_mode = ("--sample-break-mode", "eos", "--tokens-per-sample", 32)
    status, _, err = generate_run(long_line_data, tiny_lm_checkpoint, *eos_mode)
    assert status == 1 and err.strip() == (
        "fairseq-generate: error: sample 2 of 'test' is one line of 41 tokens (--sample-break-mode eos keeps lines "
        f"whole), more than {MODEL}: pass --sample-break-mode none to cut the text into blocks of "
        "--tokens-per-sample 31 or less, or --prefix-size N to prompt with each sample's first N tokens, or "
        "--skip-invalid-size-inputs-valid-test to skip such lines"
    )
    # --prefix-size: the model reads only the first 5 tokens of each line, the long one included
    status, out, _ = generate_run(long_line_data, tiny_lm_checkpoint, *eos_mode, "--prefix-size", 5)
    assert status == 0 and ids(out) == [0, 1, 2, 3, 4]
    assert re.search(r"^H-2\t\S+\tw1 w1 w1 w1 w1", out, re.M)
    status, _, err = generate_run(long_line_data, tiny_lm_checkpoint, *eos_mode, "--prefix-size", 32)
    assert status == 1 and err.strip() == (
        "fairseq-generate: error: --prefix-size 32 makes prompts that need 33 positions with the </s> generation "
        "starts from, more than the model's 32: pass --prefix-size 31 or less"
    )
    # skipped: the warning and the output name sample 2, the others are generated
    status, out, _ = generate_run(
        long_line_data, tiny_lm_checkpoint, *eos_mode, "--skip-invalid-size-inputs-valid-test"
    )
    assert status == 0 and ids(out) == [0, 1, 3, 4] and "are skipped, e.g. [2]" in out
    # blocks cut by --tokens-per-sample: that flag is named, with the value that works
    status, _, err = generate_run(
        long_line_data, tiny_lm_checkpoint, "--sample-break-mode", "none", "--tokens-per-sample", 64
    )
    assert status == 1 and err.strip() == (
        "fairseq-generate: error: --tokens-per-sample 64 makes prompts that need 57 positions with the </s> "
        "generation starts from (sample 0 of 'test' has 56 tokens; a prompt is the token before its block and all "
        f"of the block but its last token), more than {MODEL}: pass --tokens-per-sample 31 or less, or "
        "--prefix-size N to prompt with each sample's first N tokens, or --skip-invalid-size-inputs-valid-test to "
        "skip such samples"
    )


def test_generate_tokens_per_sample_of_the_model_length(tiny_data, tiny_lm_checkpoint):
    """--sample-break-mode none: a prompt is the token before its block and the block but its last token, so a
    block of the model's 32 tokens needs 33 positions with the </s> generation starts from. The error names the
    sample and the value that works; the skip flag skips those blocks (the last, shorter block is generated)."""
    none_mode = ("--sample-break-mode", "none", "--batch-size", 40)
    status, _, err = generate_run(tiny_data, tiny_lm_checkpoint, *none_mode, "--tokens-per-sample", 32)
    assert status == 1 and err.strip().count("\n") == 0 and "Traceback" not in err
    assert err.strip().startswith(
        "fairseq-generate: error: --tokens-per-sample 32 makes prompts that need 33 "
        "positions with the </s> generation starts from (sample 0 of 'test' has 32 tokens"
    )
    assert "pass --tokens-per-sample 31 or less" in err
    status, out, err = generate_run(tiny_data, tiny_lm_checkpoint, *none_mode, "--tokens-per-sample", 31)
    assert status == 0, err
    assert len(ids(out)) == len(ids(out, "S")) > 0
    status, out, err = generate_run(
        tiny_data, tiny_lm_checkpoint, *none_mode, "--tokens-per-sample", 32, "--skip-invalid-size-inputs-valid-test"
    )
    assert status == 0, err
    assert "are skipped" in out + err and 0 < len(ids(out)) < 5


def test_validate_names_the_block_size_that_fits(tiny_data, tiny_lm_checkpoint):
    """fairseq-validate reads blocks as eval-lm does: too long blocks are refused with eval-lm's message (lower
    --tokens-per-sample, not raise it), and the value it names works."""
    status, _, err = validate_run(tiny_data, tiny_lm_checkpoint, "--tokens-per-sample", 64)
    assert status == 1 and err.strip() == (
        f"fairseq-validate: error: --tokens-per-sample 64 is more than {MODEL}: "
        "sample 0 of 'test' has 64 tokens; pass --tokens-per-sample 32 or less"
    )
    status, out, err = validate_run(tiny_data, tiny_lm_checkpoint, "--tokens-per-sample", 32)
    assert status == 0 and "valid on 'test' subset" in out, err
    status, out, err = validate_run(
        tiny_data, tiny_lm_checkpoint, "--tokens-per-sample", 64, "--skip-invalid-size-inputs-valid-test"
    )
    assert status == 0 and "valid on 'test' subset" in out, err


def test_eval_lm_refuses_max_tokens_below_the_block_size(tiny_data, tiny_lm_checkpoint):
    """--max-tokens below --tokens-per-sample would skip (nearly) every packed block and print the perplexity of
    what is left (or "no tokens"): refused in one line, as fairseq-train refuses it. In eos mode a line longer
    than --max-tokens is an error naming it unless --skip-invalid-size-inputs-valid-test skips it."""
    for budget in (31, 16):
        status, _, err = eval_lm_run(tiny_data, tiny_lm_checkpoint, "--tokens-per-sample", 32, "--max-tokens", budget)
        assert status == 1 and err.strip() == (
            f"fairseq-eval-lm: error: --max-tokens {budget} is less than --tokens-per-sample 32: with "
            "--sample-break-mode none (nearly) every block has 32 tokens and would be skipped; raise --max-tokens "
            f"to at least 32, or lower --tokens-per-sample to at most {budget}"
        )
    status, _, err = eval_lm_run(
        tiny_data, tiny_lm_checkpoint, "--tokens-per-sample", 32, "--context-window", 8, "--max-tokens", 20
    )
    assert status == 1 and err.strip().endswith(
        "--max-tokens 20 is less than --tokens-per-sample 32 less --context-window 8: with --sample-break-mode none "
        "(nearly) every block has 24 tokens and would be skipped; raise --max-tokens to at least 24, or lower "
        "--tokens-per-sample to at most 28"
    )
    # the fixes it names work, and give the perplexity of the whole split
    status, whole, _ = eval_lm_run(tiny_data, tiny_lm_checkpoint, "--tokens-per-sample", 32)
    status_a, raised, _ = eval_lm_run(tiny_data, tiny_lm_checkpoint, "--tokens-per-sample", 32, "--max-tokens", 32)
    status_b, lowered, _ = eval_lm_run(tiny_data, tiny_lm_checkpoint, "--tokens-per-sample", 16, "--max-tokens", 16)
    evaluated = re.compile(r"Evaluated ([\d,]+) tokens")
    assert status == status_a == status_b == 0
    assert evaluated.search(whole)[1] == evaluated.search(raised)[1] == evaluated.search(lowered)[1]
    # eos mode (lines of up to 26 tokens, within the model's positions): a line longer than --max-tokens is named
    eos_mode = ("--sample-break-mode", "eos", "--tokens-per-sample", 32)
    status, _, err = eval_lm_run(tiny_data, tiny_lm_checkpoint, *eos_mode, "--max-tokens", 10)
    assert status == 1 and err.strip().count("\n") == 0
    assert re.fullmatch(
        r"fairseq-eval-lm: error: item \d+ has \d+ tokens, more than --max-tokens 10; raise "
        r"--max-tokens or pass --skip-invalid-size-inputs-valid-test to skip such items",
        err.strip(),
    )
    status, out, _ = eval_lm_run(
        tiny_data, tiny_lm_checkpoint, *eos_mode, "--max-tokens", 10, "--skip-invalid-size-inputs-valid-test"
    )
    assert status == 0 and "are skipped" in out
    assert 0 < int(evaluated.search(out)[1].replace(",", "")) < int(evaluated.search(whole)[1].replace(",", ""))


def test_generate_counts_the_start_token_exactly(tiny_data, tiny_lm_checkpoint, tmp_path):
    """A line of the model's 32 tokens in eos mode is a prompt of 31 tokens after the </s> generation starts
    from: it fits. A model trained with --add-bos-token starts from <s> in front of that </s>: one position more,
    refused naming the line (the generator would fail on it)."""
    from fairseq_cli import train
    from tests.train_fixtures import default_train_argv

    (tmp_path / "test.txt").write_text(" ".join(["w1"] * 31) + "\nw2 w3\n", encoding="utf-8")
    data = tmp_path / "data-bin"
    preprocess.cli_main(
        [
            "--only-source",
            "--testpref",
            str(tmp_path / "test.txt"),
            "--destdir",
            str(data),
            "--srcdict",
            str(tiny_data / "dict.txt"),
            "--workers",
            "1",
        ]
    )
    eos_mode = ("--sample-break-mode", "eos", "--tokens-per-sample", 32)
    status, out, err = generate_run(data, tiny_lm_checkpoint, *eos_mode)
    assert status == 0 and ids(out) == [0, 1], err
    train.cli_main(default_train_argv(tiny_data, tmp_path / "bos", "--add-bos-token", max_update=1))
    status, _, err = generate_run(data, tmp_path / "bos" / "checkpoint_last.pt", *eos_mode)
    assert status == 1 and err.strip().startswith(
        "fairseq-generate: error: sample 0 of 'test' is one line of 32 tokens plus the token generation starts "
        "from (--sample-break-mode eos keeps lines whole), more than the model's 32 positions"
    )
    status, out, err = generate_run(
        data, tmp_path / "bos" / "checkpoint_last.pt", *eos_mode, "--skip-invalid-size-inputs-valid-test"
    )
    assert status == 0 and ids(out) == [1], err


def test_eval_lm_with_every_block_skipped_says_so(long_line_data, tiny_lm_checkpoint, tmp_path):
    """A split whose only line is too long for the model, eos mode, skipped: the error says the flag skipped it."""
    only = tmp_path / "only"
    only.mkdir()
    for name in ("dict.txt",):
        (only / name).write_bytes((long_line_data / name).read_bytes())
    (tmp_path / "test.txt").write_text(" ".join(["w1"] * 40) + "\n", encoding="utf-8")
    preprocess.cli_main(
        [
            "--only-source",
            "--testpref",
            str(tmp_path / "test.txt"),
            "--destdir",
            str(only),
            "--srcdict",
            str(only / "dict.txt"),
            "--workers",
            "1",
        ]
    )
    status, _, err = eval_lm_run(
        only, tiny_lm_checkpoint, "--sample-break-mode", "eos", "--skip-invalid-size-inputs-valid-test"
    )
    assert status == 1 and err.strip().count("\n") == 0, err[-2000:]
    assert "split 'test' has no tokens to evaluate. --skip-invalid-size-inputs-valid-test skipped every block" in err
