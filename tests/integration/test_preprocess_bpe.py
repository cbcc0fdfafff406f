"""fairseq-preprocess --bpe: raw text encoded and binarized in one pass equals the two-step route (the encoder
script with --keep-empty, then fairseq-preprocess on its output) byte for byte; bad inputs fail with one line.
No network: the GPT-2 files and the sentencepiece model are trained here on the quickstart's sample corpus."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")

from fairseq_cli import preprocess  # noqa: E402

from tests.text_fixtures import sample_text, train_gpt2_files, train_spm_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


# Lines the two routes could treat differently: surrounding and unusual whitespace, empty lines, \r\n and a
# lone \r, a NUL, non-ASCII, and a last line without a line end.
TRICKY = (
    "  leading and trailing  \n\n\n\tTabbed\tline\t\r\nCRLF line\r\nlone\rCR\nform\x0cfeed and \u2028 sep "
    "\x85 nel\nnul \x00 inside\nnon-ASCII: café, naïve, 日本語, emoji 🙂\n   \n<unk> </s> <s> literal\n"
    "last line without newline"
)


def write_text(path, n_copies=1):
    text = sample_text()
    path.write_text((text + "\n" + TRICKY + "\n") * n_copies + TRICKY, encoding="utf-8", newline="")
    return path


def run_script(relpath, argv):
    subprocess.run(
        [sys.executable, str(ROOT / relpath)] + [str(a) for a in argv],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    train = write_text(d / "train.raw", n_copies=2)
    valid = d / "valid.raw"
    valid.write_text(TRICKY + "\n" + sample_text()[:20000] + "\nunseen wörds ÿ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢\n", encoding="utf-8", newline="")
    return train, valid


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    return train_gpt2_files(tmp_path_factory.mktemp("gpt2"), sample_text())


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    return train_spm_model(tmp_path_factory.mktemp("spm"))


def outputs(destdir):
    return {name: (destdir / name).read_bytes() for name in sorted(os.listdir(destdir)) if name != "preprocess.log"}


def run_preprocess(argv):
    preprocess.cli_main(["--only-source"] + [str(a) for a in argv])


def gpt2_two_step(tmp, corpus, gpt2_files, workers, extra=()):
    train, valid = corpus
    encoded = []
    for path in (train, valid):
        out = tmp / (path.stem + ".bpe")
        run_script(
            "examples/roberta/multiprocessing_bpe_encoder.py",
            [
                "--encoder-json",
                gpt2_files[0],
                "--vocab-bpe",
                gpt2_files[1],
                "--inputs",
                path,
                "--outputs",
                out,
                "--keep-empty",
                "--workers",
                workers,
            ],
        )
        encoded.append(out)
    dest = tmp / "two_step"
    run_preprocess(
        ["--trainpref", encoded[0], "--validpref", encoded[1], "--destdir", dest, "--workers", workers, *extra]
    )
    return dest


def spm_two_step(tmp, corpus, model, workers, extra=()):
    # spm_encode.py always drops empty lines; the text is given without them (--keep-empty has no equivalent).
    encoded = []
    for path in corpus:
        out = tmp / (path.stem + ".spm")
        run_script("scripts/spm_encode.py", ["--model", model, "--inputs", path, "--outputs", out])
        encoded.append(out)
    dest = tmp / "two_step"
    run_preprocess(
        ["--trainpref", encoded[0], "--validpref", encoded[1], "--destdir", dest, "--workers", workers, *extra]
    )
    return dest


@pytest.mark.parametrize("workers", [1, 2])
def test_gpt2_one_pass_equals_encoder_script_then_preprocess(tmp_path, corpus, gpt2_files, workers):
    two = gpt2_two_step(tmp_path, corpus, gpt2_files, workers)
    one = tmp_path / "one_pass"
    run_preprocess(
        [
            "--trainpref",
            corpus[0],
            "--validpref",
            corpus[1],
            "--destdir",
            one,
            "--workers",
            workers,
            "--bpe",
            "gpt2",
            "--gpt2-encoder-json",
            gpt2_files[0],
            "--gpt2-vocab-bpe",
            gpt2_files[1],
        ]
    )
    a, b = outputs(two), outputs(one)
    assert sorted(a) == sorted(b) == ["dict.txt", "train.bin", "train.idx", "valid.bin", "valid.idx"]
    for name in a:
        assert a[name] == b[name], name
    assert not [n for n in os.listdir(one) if n.startswith(".")]  # no cache or part files left


@pytest.mark.parametrize("workers", [1, 2])
def test_gpt2_one_pass_with_srcdict_equals_two_step(tmp_path, corpus, gpt2_files, workers):
    first = gpt2_two_step(tmp_path, corpus, gpt2_files, 1)
    srcdict = tmp_path / "dict.txt"
    srcdict.write_bytes((first / "dict.txt").read_bytes())
    (tmp_path / "two_step").rename(tmp_path / "first")
    two = gpt2_two_step(tmp_path, corpus, gpt2_files, workers, extra=("--srcdict", srcdict))
    one = tmp_path / "one_pass"
    run_preprocess(
        [
            "--trainpref",
            corpus[0],
            "--validpref",
            corpus[1],
            "--destdir",
            one,
            "--workers",
            workers,
            "--srcdict",
            srcdict,
            "--bpe",
            "gpt2",
            "--gpt2-encoder-json",
            gpt2_files[0],
            "--gpt2-vocab-bpe",
            gpt2_files[1],
        ]
    )
    assert outputs(two) == outputs(one)


@pytest.fixture(scope="module")
def spm_corpus(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("spm_corpus")
    out = []
    for path in corpus:
        text = path.read_text(encoding="utf-8")
        lines = [line for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n") if line.strip()]
        p = d / path.name
        p.write_text("\n".join(lines) + "\n", encoding="utf-8")
        out.append(p)
    return tuple(out)


@pytest.mark.parametrize("workers", [1, 2])
def test_sentencepiece_one_pass_equals_spm_encode_then_preprocess(tmp_path, spm_corpus, spm_model, workers):
    two = spm_two_step(tmp_path, spm_corpus, spm_model, workers)
    one = tmp_path / "one_pass"
    run_preprocess(
        [
            "--trainpref",
            spm_corpus[0],
            "--validpref",
            spm_corpus[1],
            "--destdir",
            one,
            "--workers",
            workers,
            "--bpe",
            "sentencepiece",
            "--sentencepiece-model",
            spm_model,
        ]
    )
    a, b = outputs(two), outputs(one)
    assert sorted(a) == ["dict.txt", "train.bin", "train.idx", "valid.bin", "valid.idx"]
    assert a == b


def test_sentencepiece_one_pass_keeps_empty_lines(tmp_path, corpus, spm_model):
    one = tmp_path / "one_pass"
    run_preprocess(
        ["--trainpref", corpus[0], "--destdir", one, "--bpe", "sentencepiece", "--sentencepiece-model", spm_model]
    )
    from fairseq.data.indexed_dataset import MMapIndexedDataset
    from fairseq.data import Dictionary

    ds = MMapIndexedDataset(str(one / "train"))
    d = Dictionary.load(str(one / "dict.txt"))
    raw = corpus[0].read_text(encoding="utf-8").replace("\r\n", "\n").replace("\r", "\n")
    lines = raw.split("\n")
    assert len(ds) == len(lines)
    empty = [i for i, line in enumerate(lines) if not line.strip()]
    assert empty and all(ds[i].tolist() == [d.eos()] for i in empty)


# ---- bad inputs ------------------------------------------------------------------------------------------
def _error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        run_preprocess(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("fairseq-preprocess: error: ") and err.count("\n") == 1, err
    return err


def test_missing_and_malformed_encoder_files(tmp_path, capsys, corpus, gpt2_files):
    dest = tmp_path / "out"
    base = ["--trainpref", corpus[0], "--destdir", dest, "--bpe", "gpt2"]
    err = _error(capsys, base + ["--gpt2-vocab-bpe", gpt2_files[1]])
    assert "--gpt2-encoder-json" in err
    err = _error(capsys, base + ["--gpt2-encoder-json", tmp_path / "nope.json", "--gpt2-vocab-bpe", gpt2_files[1]])
    assert "nope.json" in err and "does not exist" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    err = _error(capsys, base + ["--gpt2-encoder-json", bad, "--gpt2-vocab-bpe", gpt2_files[1]])
    assert "bad.json" in err and "not valid JSON" in err
    badv = tmp_path / "bad.bpe"
    badv.write_text("no version line\na b c\n", encoding="utf-8")
    err = _error(capsys, base + ["--gpt2-encoder-json", gpt2_files[0], "--gpt2-vocab-bpe", badv])
    assert "bad.bpe" in err
    assert not dest.exists()  # nothing written before the encoder loads


def test_missing_and_malformed_sentencepiece_model(tmp_path, capsys, corpus):
    pytest.importorskip("sentencepiece")
    base = ["--trainpref", corpus[0], "--destdir", tmp_path / "out", "--bpe", "sentencepiece"]
    assert "--sentencepiece-model" in _error(capsys, base)
    assert "does not exist" in _error(capsys, base + ["--sentencepiece-model", tmp_path / "no.model"])
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"\x00\x01 not a model")
    assert "junk.model" in _error(capsys, base + ["--sentencepiece-model", junk])


def test_srcdict_missing_encoder_ids_maps_to_unk_and_warns_once(tmp_path, corpus, gpt2_files, caplog):
    srcdict = tmp_path / "dict.txt"
    srcdict.write_text("".join(f"{i} 1\n" for i in range(100)), encoding="utf-8")  # ids 100+ missing
    dest = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="fairseq_cli.preprocess"):
        run_preprocess(
            [
                "--trainpref",
                corpus[0],
                "--validpref",
                corpus[1],
                "--destdir",
                dest,
                "--srcdict",
                srcdict,
                "--bpe",
                "gpt2",
                "--gpt2-encoder-json",
                gpt2_files[0],
                "--gpt2-vocab-bpe",
                gpt2_files[1],
            ]
        )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(srcdict) in warnings[0] and "<unk>" in warnings[0] and "omit --srcdict" in warnings[0]
    assert (dest / "train.bin").exists() and (dest / "valid.idx").exists()


def test_undecodable_bytes_fail_naming_the_file_and_keep_the_old_output(tmp_path, capsys, corpus, gpt2_files):
    dest = tmp_path / "out"
    args = [
        "--destdir",
        dest,
        "--bpe",
        "gpt2",
        "--gpt2-encoder-json",
        gpt2_files[0],
        "--gpt2-vocab-bpe",
        gpt2_files[1],
        "--workers",
        "2",
    ]
    run_preprocess(["--trainpref", corpus[0], "--validpref", corpus[1]] + args)
    good = outputs(dest)
    bad = tmp_path / "bad.raw"
    bad.write_bytes(corpus[1].read_bytes()[:5000] + b"\nbad \xff\xfe byte\n" + corpus[1].read_bytes())
    err = _error(capsys, ["--srcdict", dest / "dict.txt", "--trainpref", corpus[0], "--validpref", bad] + args)
    assert "bad.raw" in err and "UTF-8" in err
    after = outputs(dest)
    assert after["valid.bin"] == good["valid.bin"] and after["valid.idx"] == good["valid.idx"]
    assert not [n for n in os.listdir(dest) if n.startswith(".")]
    # while building the dictionary: nothing replaced, no cache left
    err = _error(capsys, ["--trainpref", bad] + args)
    assert "bad.raw" in err
    assert outputs(dest)["dict.txt"] == good["dict.txt"]
    assert not [n for n in os.listdir(dest) if n.startswith(".")]


@pytest.mark.parametrize("scheme", ["characters", "bytes"])
def test_schemes_without_options_equal_their_encode_then_preprocess(tmp_path, corpus, scheme):
    from fairseq.data.encoders import build_bpe

    bpe = build_bpe(scheme)
    raw = corpus[1].read_text(encoding="utf-8").replace("\r\n", "\n").replace("\r", "\n")
    lines = raw.split("\n")
    if lines[-1] == "":
        lines.pop()
    encoded = tmp_path / "valid.enc"
    encoded.write_text("".join(bpe.encode(line.strip()) + "\n" for line in lines), encoding="utf-8")
    run_preprocess(["--trainpref", encoded, "--destdir", tmp_path / "two", "--workers", 2])
    run_preprocess(["--trainpref", corpus[1], "--destdir", tmp_path / "one", "--workers", 2, "--bpe", scheme])
    assert outputs(tmp_path / "two") == outputs(tmp_path / "one")
