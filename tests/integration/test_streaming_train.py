"""fairseq-train --task streaming_language_modeling: kill -9 and resume equals the uninterrupted run (a real
subprocess, bitwise on CPU), per-corpus validation and token counts in the log, and every bad input as one line
naming the file (and line) and the fix."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.streaming_fixtures import write_jsonl_corpora
from tests.train_fixtures import train_in_process

TINY = [
    "--task",
    "streaming_language_modeling",
    "--arch",
    "transformer_lm",
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
    "--share-decoder-input-output-embed",
    "--optimizer",
    "adam",
    "--lr",
    "0.002",
    "--tokens-per-sample",
    "16",
    "--batch-size",
    "2",
    "--cpu",
    "--seed",
    "3",
    "--log-format",
    "json",
    "--log-interval",
    "1",
]


@pytest.fixture()
def data(tmp_path):
    return write_jsonl_corpora(tmp_path / "d", docs=60, valid_docs=6)


def argv(data, save_dir, *extra, max_update=4, workers="0"):
    return [
        str(data),
        *TINY,
        "--save-dir",
        str(save_dir),
        "--max-update",
        str(max_update),
        "--num-workers",
        workers,
        *extra,
    ]


def one_error_line(status, err):
    assert status == 1 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_kill_9_and_resume_equals_the_uninterrupted_run(data, tmp_path):
    common = ["--data-weights", "web=0.7,books=0.3", "--save-interval-updates", "4", "--disable-validation"]
    # The reference and the resumed run in this process, tokenizing in the data thread; the killed one a real
    # fairseq-train process with a tokenizing worker process (the ids do not depend on where they are made).
    assert train_in_process(argv(data, tmp_path / "whole", *common, max_update=24))[0] == 0
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")  # one thread, as train_in_process
    run = subprocess.Popen(
        [sys.executable, "-m", "fairseq_cli.train"] + argv(data, tmp_path / "cut", *common, max_update=24, workers="1"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in run.stdout:  # killed once update 6 is logged: checkpoint_last (update 4) is on disk
        if '"num_updates": "6"' in line:
            run.send_signal(signal.SIGKILL)
            break
    run.wait(timeout=60)
    assert run.returncode == -signal.SIGKILL
    status, out, err = train_in_process(argv(data, tmp_path / "cut", *common, max_update=24))
    assert status == 0 and "loaded checkpoint" in out and "(4 updates)" in out, err
    a = torch.load(tmp_path / "whole" / "checkpoint_last.pt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "checkpoint_last.pt", weights_only=True)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    sa, sb = (x["extra_state"]["train_iterator"]["streaming"] for x in (a, b))
    assert sa["sample"] == sb["sample"] == 48 and sa["tokens"] == sb["tokens"]
    assert sum(sa["tokens"].values()) == 48 * 16
    for name in ("web", "books"):
        assert sa["corpora"][name]["offset"] == sb["corpora"][name]["offset"]


def test_per_corpus_validation_and_tokens_in_the_log(data, tmp_path):
    status, out, err = train_in_process(argv(data, tmp_path / "ck", "--valid-subset", "valid,valid_web,valid_books"))
    assert status == 0, err
    lines = [json.loads(line.split(" | ")[-1]) for line in out.splitlines() if line.rstrip().endswith("}")]
    keys = set().union(*lines)
    assert {"valid_loss", "valid_web_loss", "valid_books_loss", "valid_web_ppl", "tokens_web", "tokens_books"} <= keys
    last = [x for x in lines if "tokens_web" in x][-1]
    assert int(last["tokens_web"]) + int(last["tokens_books"]) == 4 * 2 * 16


def test_changed_shard_is_refused_on_resume_unless_told(data, tmp_path):
    save = tmp_path / "ck"
    assert train_in_process(argv(data, save, "--disable-validation"))[0] == 0
    web = data / "train" / "00" / "web.jsonl"
    web.write_text("".join(web.read_text().splitlines(keepends=True)[:3]))  # truncated
    line = one_error_line(*train_in_process(argv(data, save, "--disable-validation", max_update=6))[::2])
    assert str(web) in line and "--ignore-data-changes" in line
    status, _, err = train_in_process(argv(data, save, "--disable-validation", "--ignore-data-changes", max_update=6))
    assert status == 0, err
    web.unlink()  # removed
    line = one_error_line(*train_in_process(argv(data, save, "--disable-validation", max_update=8))[::2])
    assert "web" in line and "removed" in line


def test_vocabulary_other_than_the_checkpoints_is_refused(data, tmp_path):
    save = tmp_path / "ck"
    assert train_in_process(argv(data, save, "--disable-validation"))[0] == 0
    with open(data / "dict.txt", "a") as f:
        f.write("extra 1\n")
    line = one_error_line(*train_in_process(argv(data, save, "--disable-validation", max_update=6))[::2])
    assert "dict" in line.lower()


def bad_line(data, text: bytes):
    with open(data / "train" / "00" / "web.jsonl", "ab") as f:
        f.write(text)
    return f"{data / 'train' / '00' / 'web.jsonl'}, line 61"


@pytest.mark.parametrize(
    "text,says",
    [
        (b'{"text": oops}\n', "not a JSON object"),
        (b'{"body": "w1"}\n', "no string under key 'text'"),
        (b'{"text": "\xff\xfe"}\n', "not valid UTF-8"),
    ],
)
def test_invalid_document_names_file_and_line_or_is_skipped(data, tmp_path, text, says):
    where = bad_line(data, text)
    run = argv(data, tmp_path / "ck", "--disable-validation", "--data-weights", "web=1", max_update=40)
    line = one_error_line(*train_in_process(run)[::2])
    assert where in line and says in line and "--skip-invalid-documents" in line
    status, out, err = train_in_process(run + ["--skip-invalid-documents"])
    assert status == 0, err
    assert "skipped an invalid document (1 so far in corpus 'web'" in out and where in out


@pytest.mark.parametrize(
    "extra,says",
    [
        (["--data-weights", "web=-1"], "--data-weights web=-1: a weight must be >= 0"),
        (["--data-weights", "web=0,books=0"], "all weights are 0"),
        (["--data-weights", "news=1"], "names corpus 'news', which the data does not have"),
        (["--hf-tokenizer", "/no/such/tokenizer.json"], "--hf-tokenizer /no/such/tokenizer.json: no such file"),
        (["--vocab-filename", "v.json"], "--vocab-filename and --merges-filename go together"),
        (["--end-of-document-symbol", "<eod>"], "--end-of-document-symbol '<eod>' is not in the vocabulary"),
    ],
)
def test_bad_flags_are_one_line(data, tmp_path, extra, says):
    line = one_error_line(*train_in_process(argv(data, tmp_path / "ck", "--disable-validation", *extra))[::2])
    assert says in line


def test_unloadable_tokenizer_and_empty_inputs_are_one_line(data, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    line = one_error_line(
        *train_in_process(argv(data, tmp_path / "ck", "--hf-tokenizer", str(tmp_path / "tokenizer.json")))[::2]
    )
    assert "tokenizer.json: not a loadable tokenizer" in line
    (data / "train" / "00" / "web.jsonl").write_text("\n")
    line = one_error_line(
        *train_in_process(argv(data, tmp_path / "ck", "--disable-validation", "--data-weights", "web=1"))[::2]
    )
    assert "corpus 'web' has no document" in line
    for path in (data / "train" / "00").iterdir():
        path.unlink()
    line = one_error_line(*train_in_process(argv(data, tmp_path / "ck", "--disable-validation"))[::2])
    assert f"{data / 'train'} has no *.jsonl" in line


def test_changing_the_rates_on_resume_is_logged(data, tmp_path):
    save = tmp_path / "ck"
    assert train_in_process(argv(data, save, "--disable-validation", "--data-weights", "web=1,books=1"))[0] == 0
    status, out, err = train_in_process(
        argv(data, save, "--disable-validation", "--data-weights", "web=3,books=1", max_update=6)
    )
    assert status == 0, err
    assert "data rates changed on resume at sample 8: books=0.5,web=0.5 -> books=0.25,web=0.75" in out


def test_bpe_and_hf_tokenizer_routes_train(data, tmp_path):
    from fairseq_cli import preprocess
    from tests.text_fixtures import sample_text, train_gpt2_files

    enc, vocab = train_gpt2_files(tmp_path, sample_text()[:50000], vocab_size=300)
    gpt2 = ["--bpe", "gpt2", "--gpt2-encoder-json", str(enc), "--gpt2-vocab-bpe", str(vocab)]
    preprocess.cli_main(
        [
            "--only-source",
            "--json-key",
            "text",
            "--trainpref",
            str(data / "train"),
            "--destdir",
            str(tmp_path / "bin"),
            *gpt2,
        ]
    )
    (data / "dict.txt").write_bytes((tmp_path / "bin" / "dict.txt").read_bytes())  # the data-bin's vocabulary
    status, out, err = train_in_process(argv(data, tmp_path / "gpt2", "--disable-validation", *gpt2))
    assert status == 0 and "dictionary: " in out and "--bpe" not in err, err

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>"] + [f"w{i}" for i in range(40)])}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    status, out, err = train_in_process(
        argv(data, tmp_path / "hf", "--disable-validation", "--hf-tokenizer", str(tmp_path / "tokenizer.json"))
    )
    assert status == 0 and "dictionary: 48 types (hf" in out, err
