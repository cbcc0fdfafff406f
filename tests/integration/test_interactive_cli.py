"""fairseq-interactive through its entry point (in-process, and once as a real process reading a pipe) on a
tiny model trained here by fairseq-train: upstream's S-/W-/H-/D-/P- lines, in input order, equal to what the
hub interface gives for the same prompts; bad input is one line naming the flag, exit status non-zero."""

import io
import logging
import math
import os
import re
import subprocess
import sys

import pytest

from fairseq import checkpoint_utils
from fairseq.hub.hub_utils import GeneratorHubInterface
from fairseq.utils import run_console_script
from fairseq_cli import interactive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINE = re.compile(r"^([SWHDP])-(\d+)\t(.*)$")
PROMPTS = ["w1 w2 w3", "w4", "w5 w1", "w9 w0 w0 w3"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread


@pytest.fixture(scope="module")
def ckpt(tiny_lm_checkpoint):
    return tiny_lm_checkpoint


def argv(tiny_data, ckpt, *extra):
    return [
        str(tiny_data),
        "--task",
        "language_modeling",
        "--path",
        str(ckpt),
        "--cpu",
        "--num-workers",
        "0",
        *map(str, extra),
    ]


def run(monkeypatch, capsys, args, stdin_text):
    """fairseq-interactive's console entry point on `args` with `stdin_text` as standard input:
    (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin_text))
    capsys.readouterr()
    try:
        run_console_script("fairseq-interactive", interactive.cli_main, args)
        status = 0
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def parse(stdout):
    """[(kind, id, fields)] of the S-/W-/H-/D-/P- lines, in order."""
    rows = []
    for line in stdout.splitlines():
        m = LINE.match(line)
        if m:
            rows.append((m.group(1), int(m.group(2)), m.group(3).split("\t")))
    return rows


def test_lines_in_input_order_equal_the_hub(tiny_data, ckpt, monkeypatch, capsys):
    status, out, _ = run(
        monkeypatch,
        capsys,
        argv(tiny_data, ckpt, "--beam", 2, "--nbest", 2, "--max-len-b", 12, "--buffer-size", 3, "--batch-size", 2),
        "\n".join(PROMPTS) + "\n",
    )
    assert status == 0
    rows = parse(out)
    assert [(kind, i) for kind, i, _ in rows] == [
        (kind, i) for i in range(len(PROMPTS)) for kind in ("S", "W") + ("H", "D", "P") * 2
    ]
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(ckpt)], arg_overrides={"data": str(tiny_data)}
    )
    hub = GeneratorHubInterface(cfg, task, models)
    for i, prompt in enumerate(PROMPTS):
        mine = [fields for kind, j, fields in rows if j == i]
        assert mine[0] == [prompt]  # S-: the prompt's dictionary tokens
        assert mine[1][1] == "seconds" and float(mine[1][0]) >= 0
        expected = hub.generate(hub.encode(prompt), beam=2, max_len_b=12)
        for k, hypo in enumerate(expected[:2]):
            (score, tokens), (d_score, text), (positional,) = mine[2 + 3 * k : 5 + 3 * k]
            assert tokens == text == hub.string(hypo["tokens"])
            assert tokens.startswith(prompt)
            assert float(score) == float(d_score) == pytest.approx(float(hypo["score"]) / math.log(2), abs=1e-5)
            base2 = [float(x) / math.log(2) for x in hypo["positional_scores"]]
            assert [float(x) for x in positional.split()] == pytest.approx(base2, abs=6e-5)


def test_console_script_reads_a_pipe_and_input_files(tiny_data, ckpt, tmp_path, monkeypatch, capsys):
    args = argv(tiny_data, ckpt, "--beam", 1, "--max-len-b", 6)
    status, piped, _ = run(monkeypatch, capsys, args, "w1 w2\nw3\n")
    assert status == 0
    hypotheses = {i: fields[1] for kind, i, fields in parse(piped) if kind == "H"}
    assert hypotheses[0].startswith("w1 w2") and hypotheses[1].startswith("w3") and len(hypotheses) == 2
    # the real process reading a pipe, with --text-only: standard output holds the text alone, the log goes to
    # standard error
    text_only = subprocess.run(
        [sys.executable, "-m", "fairseq_cli.interactive", *args, "--text-only"],
        input="w1 w2\nw3\n",
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
        timeout=300,
    )
    assert text_only.returncode == 0, text_only.stderr[-3000:]
    assert text_only.stdout.splitlines() == [fields[1] for kind, _, fields in parse(piped) if kind == "D"]
    assert "| INFO | fairseq_cli.interactive |" in text_only.stderr
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2\nw3\n", encoding="utf-8")
    status, out, _ = run(monkeypatch, capsys, args + ["--input", str(prompts)], "")
    assert status == 0
    assert [r for r in parse(out) if r[0] != "W"] == [r for r in parse(piped) if r[0] != "W"]


def test_without_data_the_checkpoints_dictionary_is_used(tiny_data, ckpt, monkeypatch, capsys):
    flags = ["--path", str(ckpt), "--cpu", "--beam", "2", "--max-len-b", "6"]
    _, with_data, _ = run(monkeypatch, capsys, [str(tiny_data)] + flags, "w1 w2\n")
    status, without, _ = run(monkeypatch, capsys, flags, "w1 w2\n")  # DATA saved in the checkpoint's config
    assert status == 0
    assert [r for r in parse(without) if r[0] != "W"] == [r for r in parse(with_data) if r[0] != "W"]


def test_prompt_longer_than_the_model(tiny_data, ckpt, monkeypatch, capsys, caplog):
    long_prompt = " ".join(["w1"] * 40)
    status, out, err = run(monkeypatch, capsys, argv(tiny_data, ckpt, "--beam", 1), long_prompt + "\nw2\n")
    assert status == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "fairseq-interactive: error: prompt 0 is 41 tokens long (with the </s> it starts from), more than the "
        "model's 32 positions (the --tokens-per-sample / --max-target-positions it was trained with); shorten the "
        "prompt, or pass --skip-invalid-size-inputs-valid-test to skip such prompts"
    )
    # skipped: the warning names the prompt's number in the input (here the third, read in a buffer of its own)
    with caplog.at_level(logging.WARNING):
        status, out, _ = run(
            monkeypatch,
            capsys,
            argv(tiny_data, ckpt, "--beam", 1, "--max-len-b", 5, "--skip-invalid-size-inputs-valid-test"),
            f"w2\nw3\n{long_prompt}\nw4\n",
        )
    assert status == 0
    assert [i for kind, i, _ in parse(out) if kind == "H"] == [0, 1, 3]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "prompt 2 is 41 tokens long (with the </s> it starts from), more than the model's 32 positions: skipped "
        "(--skip-invalid-size-inputs-valid-test)"
    ]


@pytest.mark.parametrize(
    "extra, stdin_text, status, message",
    [
        (["--beam", 5, "--sampling"], "w1\n", 2, "--sampling requires --nbest to be equal to --beam"),
        (["--sampling-topk", 5], "w1\n", 1, "--sampling-topk 5 requires --sampling"),
        (
            ["--sampling-topk", -5],
            "w1\n",
            2,
            "--sampling-topk -5 is out of range: -1 (off: all tokens) or a number of tokens, at least 1",
        ),
        (
            ["--sampling", "--beam", 1, "--sampling-topp", -0.5],
            "w1\n",
            2,
            "--sampling-topp -0.5 is out of range: -1 (off: all tokens) or a probability mass in (0, 1]",
        ),
        (["--sampling", "--beam", 1, "--sampling-topp", 1.5], "w1\n", 2, "--sampling-topp 1.5 is out of range"),
        (
            ["--batch-size", 4, "--buffer-size", 2],
            "w1\n",
            2,
            "--batch-size/--max-sentences 4 cannot be larger than --buffer-size 2",
        ),
        (["--beams", 2], "w1\n", 2, "unrecognized arguments: --beams 2"),
        (["--model-overrides", "{'decoder_layers': 3}"], "w1\n", 1, "was saved from a different architecture"),
        (["--input", "missing.txt"], "", 1, "--input missing.txt: no such file"),
        ([], "w1\n\nw2\n", 1, "prompt 1 is an empty line"),
    ],
)
def test_bad_input_is_one_line(tiny_data, ckpt, monkeypatch, capsys, extra, stdin_text, status, message):
    got, _, err = run(monkeypatch, capsys, argv(tiny_data, ckpt, *extra), stdin_text)
    assert got == status and "Traceback" not in err
    assert err.strip().count("\n") == 0 and ": error: " in err and message in err  # usage errors too: one line


def test_a_prompt_longer_than_the_output_allowed_is_cut_there_with_a_warning(
    tiny_data, ckpt, monkeypatch, capsys, caplog
):
    status, out, _ = run(monkeypatch, capsys, argv(tiny_data, ckpt, "--max-len-b", 4), " ".join(["w1"] * 10) + "\n")
    assert status == 0
    assert [fields[1] for kind, _, fields in parse(out) if kind == "H"] == ["w1 w1 w1 w1"]  # upstream's output
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "a prompt of 10 tokens is longer than the longest output allowed, 4 tokens (--max-len-a 0 * source length "
        "+ --max-len-b 4): the output is its first 4 tokens, as upstream's generator gives (said once); raise "
        "--max-len-b to continue the prompts"
    ]


def test_missing_checkpoint(tiny_data, tmp_path, monkeypatch, capsys):
    status, _, err = run(monkeypatch, capsys, argv(tiny_data, tmp_path / "nope.pt"), "w1\n")
    assert status == 1
    assert (
        err.strip() == f"fairseq-interactive: error: --path {tmp_path / 'nope.pt'}: no such checkpoint file or "
        "sharded checkpoint directory"
    )


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_text_only_and_the_prompt_only_on_a_terminal(tiny_data, ckpt, monkeypatch, capsys, caplog):
    args = argv(tiny_data, ckpt, "--beam", 2, "--nbest", 2, "--max-len-b", 8, "--buffer-size", 3, "--batch-size", 2)
    stdin_text = "\n".join(PROMPTS) + "\n"
    with caplog.at_level(logging.INFO):
        status, full, _ = run(monkeypatch, capsys, args, stdin_text)
    assert status == 0
    assert "Type the input sentence" not in caplog.text  # standard input is no terminal here
    # --text-only: the D- lines' text alone, one line per hypothesis, in the same order (prompt, then best first)
    status, text, _ = run(monkeypatch, capsys, args + ["--text-only"], stdin_text)
    assert status == 0
    assert text.splitlines() == [fields[1] for kind, _, fields in parse(full) if kind == "D"]
    assert len(text.splitlines()) == 2 * len(PROMPTS)
    caplog.clear()
    monkeypatch.setattr(sys, "stdin", _Terminal("w1\n"))
    with caplog.at_level(logging.INFO):
        run_console_script(
            "fairseq-interactive", interactive.cli_main, argv(tiny_data, ckpt, "--beam", 1, "--max-len-b", 4)
        )
    assert "Type the input sentence and press return:" in caplog.text


class _Chunks(io.StringIO):
    """Standard output that records each write: --stream writes a piece per chunk of tokens."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


@pytest.mark.parametrize("sampling", [[], ["--sampling", "--sampling-topk", 5, "--seed", 3]])
def test_stream_prints_the_text_only_lines_in_pieces(tiny_data, ckpt, monkeypatch, capsys, caplog, sampling):
    args = argv(tiny_data, ckpt, "--beam", 1, "--max-len-b", 30, "--min-len", 24, "--buffer-size", 2, *sampling)
    stdin_text = "\n".join(PROMPTS) + "\n"
    status, text, _ = run(monkeypatch, capsys, args + ["--text-only"], stdin_text)
    assert status == 0 and len(text.splitlines()) == len(PROMPTS)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin_text))
    chunks = _Chunks()
    monkeypatch.setattr(sys, "stdout", chunks)
    run_console_script("fairseq-interactive", interactive.cli_main, args + ["--stream"])
    assert chunks.getvalue() == text  # the same lines: sampling draws are keyed by the prompt's number
    pieces = [w for w in chunks.writes if w and w != "\n"]
    assert len(pieces) >= 2 * len(PROMPTS)  # 24+ tokens each: a piece per chunk of 16, at least two
    # the time spent decoding (was 0.000 with --stream): at least 4 prompts x 24 tokens of decoding steps
    times = re.findall(r"Total time: ([\d.]+) seconds; translation time: ([\d.]+)$", caplog.text, re.M)
    total, translation = map(float, times[-1])
    assert 0.001 <= translation <= total


def test_carriage_returns_end_lines_as_universal_newlines_do(tiny_data, ckpt, tmp_path, monkeypatch, capsys):
    """\r, \r\n and \n each end a prompt, on standard input (which Python splits at \n alone) as in an --input
    file (was: "w1 w2\rw3" one prompt)."""
    args = argv(tiny_data, ckpt, "--beam", 1, "--max-len-b", 6)
    status, out, _ = run(monkeypatch, capsys, args, "w1 w2\rw3\r\nw4\nw5 w6\r")
    assert status == 0
    assert [fields[0] for kind, _, fields in parse(out) if kind == "S"] == ["w1 w2", "w3", "w4", "w5 w6"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"w1 w2\rw3\r\nw4\nw5 w6\r")
    status, from_file, _ = run(monkeypatch, capsys, args + ["--input", str(prompts)], "")
    assert status == 0 and [r for r in parse(from_file) if r[0] != "W"] == [r for r in parse(out) if r[0] != "W"]


@pytest.mark.parametrize(
    "extra,message",
    [(["--stream", "--beam", 2, "--nbest", 1], "--stream needs --beam 1 (greedy or --sampling), got --beam 2")],
)
def test_stream_needs_beam_one(tiny_data, ckpt, monkeypatch, capsys, extra, message):
    status, _, err = run(monkeypatch, capsys, argv(tiny_data, ckpt, *extra), "w1\n")
    assert status == 2 and message in err and err.strip().count("\n") == 0
