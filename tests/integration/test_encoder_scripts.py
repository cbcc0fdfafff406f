"""The data-preparation scripts end to end, as subprocesses run from outside the repository (no install
needed): examples/roberta/multiprocessing_bpe_encoder.py against upstream's line handling, scripts/spm_*.py
against sentencepiece driven as upstream's scripts drive it, and raw text -> GPT-2 ids -> dict.txt ->
fairseq-preprocess --srcdict as examples/large_lm/README.md describes it."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tokenizers")
spm = pytest.importorskip("sentencepiece")

from tests.text_fixtures import sample_text, train_gpt2_files  # noqa: E402
from tests.train_fixtures import assert_group_gone, interrupt_once  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENCODER_SCRIPT = os.path.join(ROOT, "examples", "roberta", "multiprocessing_bpe_encoder.py")


def run(script, *args, stdin=None, cwd=None, max_file_size=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def limit_file_size():  # the process's limit (ulimit -f): a write past it fails with EFBIG, even for root
        if max_file_size is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_size, max_file_size))

    return subprocess.run(
        [sys.executable, script, *map(str, args)],
        input=stdin,
        capture_output=True,
        cwd=cwd,
        env=env,
        timeout=300,
        preexec_fn=limit_file_size,
    )


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    return train_gpt2_files(tmp_path_factory.mktemp("gpt2_bpe"), sample_text(), vocab_size=1000)


@pytest.fixture(scope="module")
def encoder(gpt2_files):
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    return get_encoder(*gpt2_files)


def upstream_bpe_output(encoder, inputs, keep_empty):
    """What upstream's script writes: inputs read in text mode and zipped, each line stripped, a line
    number dropped when any of its lines is empty (unless keep_empty), ids joined by spaces."""
    files = [open(p, "r", encoding="utf-8") for p in inputs]
    outs, dropped = [[] for _ in inputs], 0
    try:
        for lines in zip(*files):
            encoded = []
            for line in lines:
                line = line.strip()
                if not line and not keep_empty:
                    break
                encoded.append(" ".join(map(str, encoder.encode(line))))
            else:
                for out, enc in zip(outs, encoded):
                    out.append(enc + "\n")
                continue
            dropped += 1
    finally:
        for f in files:
            f.close()
    return ["".join(o) for o in outs], dropped


AWKWARD = (
    "Hello world\n\n   \n  indented line  \r\nmac\rline\n\u3000ideographic space\u3000\n"
    "tab\tinside\t\nnaïve café 日本語 😀\n\x0bvertical tab\x0c\ntrailing\u00a0\nlast line, no newline"
)


@pytest.mark.parametrize("keep_empty", [False, True])
def test_bpe_encoder_matches_upstream_on_several_inputs_and_workers(tmp_path, gpt2_files, encoder, keep_empty):
    body = sample_text().split("\n")
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_bytes((AWKWARD + "\n" + "\n".join(body * 2)).encode("utf-8"))  # ~20k lines: several chunks
    b.write_bytes(("\n".join(reversed(body * 2)) + "\n\nextra lines beyond a's end\n" * 3000).encode("utf-8"))
    want, dropped = upstream_bpe_output(encoder, [a, b], keep_empty)
    outputs = {}
    for workers in (1, 2):
        oa, ob = tmp_path / f"a{workers}.bpe", tmp_path / f"b{workers}.bpe"
        flags = ["--keep-empty"] if keep_empty else []
        proc = run(
            ENCODER_SCRIPT,
            "--encoder-json",
            gpt2_files[0],
            "--vocab-bpe",
            gpt2_files[1],
            "--inputs",
            a,
            b,
            "--outputs",
            oa,
            ob,
            "--workers",
            workers,
            *flags,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr.decode()
        outputs[workers] = (oa.read_text(encoding="utf-8"), ob.read_text(encoding="utf-8"))
        err = proc.stderr.decode()
        assert "processed 10000 lines\nprocessed 20000 lines\n" in err
        assert (f"[num_filtered_EMPTY] filtered {dropped} lines" in err) == (dropped > 0)
    assert outputs[1] == outputs[2] == tuple(want)
    assert (dropped > 0) != keep_empty
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".part")]


@pytest.mark.parametrize("keep_empty", [False, True])
def test_bpe_encoder_single_input_in_blocks_matches_upstream(tmp_path, gpt2_files, encoder, keep_empty):
    """One input goes to the workers as blocks of bytes (split into lines there): several blocks, line ends
    \\n, \\r\\n and lone \\r, empty and blank lines, no final newline."""
    body = sample_text().split("\n")
    data = "\r\n".join(body) + "\n" + AWKWARD + "\r" + "\n\n".join(reversed(body)) + "\n  \n\n" + AWKWARD
    a = tmp_path / "a.txt"
    a.write_bytes(data.encode("utf-8"))
    assert a.stat().st_size > (1 << 19)  # two blocks at least
    want, dropped = upstream_bpe_output(encoder, [a], keep_empty)
    for workers in (1, 2):
        out = tmp_path / f"a{workers}.bpe"
        flags = ["--keep-empty"] if keep_empty else []
        proc = run(
            ENCODER_SCRIPT,
            "--encoder-json",
            gpt2_files[0],
            "--vocab-bpe",
            gpt2_files[1],
            "--inputs",
            a,
            "--outputs",
            out,
            "--workers",
            workers,
            *flags,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr.decode()
        assert out.read_text(encoding="utf-8") == want[0]
        err = proc.stderr.decode()
        assert "processed 10000 lines\nprocessed 20000 lines\n" in err
        assert (f"[num_filtered_EMPTY] filtered {dropped} lines" in err) == (dropped > 0)
    lines = data.encode("utf-8").replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    lines[18000] = b"bad \xff byte"
    a.write_bytes(b"\n".join(lines))
    proc = run(
        ENCODER_SCRIPT,
        "--encoder-json",
        gpt2_files[0],
        "--vocab-bpe",
        gpt2_files[1],
        "--inputs",
        a,
        "--outputs",
        tmp_path / "bad.bpe",
        "--workers",
        "2",
    )
    assert proc.returncode == 1 and "a.txt, line 18001: not valid UTF-8" in proc.stderr.decode()
    assert "Traceback" not in proc.stderr.decode() and not (tmp_path / "bad.bpe").exists()


def test_bpe_encoder_stdin_stdout(gpt2_files, encoder, tmp_path):
    proc = run(
        ENCODER_SCRIPT,
        "--encoder-json",
        gpt2_files[0],
        "--vocab-bpe",
        gpt2_files[1],
        "--workers",
        "1",
        stdin="Hello world\n\n  the end  \n".encode(),
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode() == "".join(
        " ".join(map(str, encoder.encode(t))) + "\n" for t in ["Hello world", "the end"]
    )
    assert "[num_filtered_EMPTY] filtered 1 lines" in proc.stderr.decode()


def test_bpe_encoder_errors_leave_existing_outputs_alone(gpt2_files, tmp_path):
    good, out = tmp_path / "good.txt", tmp_path / "out.bpe"
    good.write_text("fine\n" * 10, encoding="utf-8")
    out.write_text("previous complete output\n", encoding="utf-8")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"line one\nline two\nline \xff three\n")
    proc = run(
        ENCODER_SCRIPT,
        "--encoder-json",
        gpt2_files[0],
        "--vocab-bpe",
        gpt2_files[1],
        "--inputs",
        bad,
        "--outputs",
        out,
        "--workers",
        "2",
    )
    assert proc.returncode == 1
    assert "bad.txt, line 3: not valid UTF-8" in proc.stderr.decode() and "Traceback" not in proc.stderr.decode()
    assert out.read_text(encoding="utf-8") == "previous complete output\n"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".part")]

    proc = run(
        ENCODER_SCRIPT,
        "--encoder-json",
        tmp_path / "missing.json",
        "--vocab-bpe",
        gpt2_files[1],
        "--inputs",
        good,
        "--outputs",
        out,
    )
    assert proc.returncode == 1 and "missing.json' does not exist" in proc.stderr.decode()
    assert "pass the encoder.json the data was encoded with" in proc.stderr.decode()  # not advice to fetch GPT-2s
    proc = run(
        ENCODER_SCRIPT,
        "--encoder-json",
        gpt2_files[0],
        "--vocab-bpe",
        gpt2_files[1],
        "--inputs",
        good,
        good,
        "--outputs",
        out,
    )
    assert proc.returncode == 2 and "number of input and output paths should match" in proc.stderr.decode()
    proc = run(ENCODER_SCRIPT, "--inputs", good, "--outputs", out)
    assert proc.returncode == 2 and "--encoder-json is required" in proc.stderr.decode()
    assert out.read_text(encoding="utf-8") == "previous complete output\n"

    proc = run(
        ENCODER_SCRIPT,
        "--encoder-json",
        gpt2_files[0],
        "--vocab-bpe",
        gpt2_files[1],
        "--inputs",
        good,
        "--outputs",
        out,
        "--workers",
        "1",
    )
    assert proc.returncode == 0 and out.read_text(encoding="utf-8").count("\n") == 10


@pytest.mark.parametrize("script", ["bpe", "spm"])
def test_outputs_named_twice_or_also_inputs_are_refused(gpt2_files, spm_model, tmp_path, script):
    """The same file twice in --outputs would keep one split's encoding and lose the other's; an output that is
    also an input would replace the text by its encoding. Both are refused, nothing written."""
    a, b, out = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "out.txt"
    a.write_text("first split\n", encoding="utf-8")
    b.write_text("second split\n", encoding="utf-8")
    out.write_text("previous complete output\n", encoding="utf-8")
    cmd = (
        (ENCODER_SCRIPT, "--encoder-json", gpt2_files[0], "--vocab-bpe", gpt2_files[1])
        if script == "bpe"
        else (os.path.join(ROOT, "scripts", "spm_encode.py"), "--model", spm_model)
    )
    for outputs, said in (([out, tmp_path / "." / "out.txt"], "twice"), ([out, b], "is also an input")):
        proc = run(*cmd, "--inputs", a, b, "--outputs", *outputs)
        err = proc.stderr.decode().strip().splitlines()
        assert proc.returncode == 1 and len(err) == 1 and said in err[0], err
        assert str(outputs[1]) in err[0] and "Traceback" not in err[0]
    assert out.read_text(encoding="utf-8") == "previous complete output\n"
    assert b.read_text(encoding="utf-8") == "second split\n"
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt", "out.txt"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_one_signal_ends_the_encoder_leaving_no_part_file(gpt2_files, tmp_path, sig):
    """Ctrl-C (SIGINT to the process group, workers included) or SIGTERM to the script, once, mid-run: it ends
    within seconds with one line and 128 + the signal's number, its hidden .part file removed and the earlier
    output intact."""
    big, out = tmp_path / "big.txt", tmp_path / "out.bpe"
    with open(big, "w", encoding="utf-8") as f:
        for _ in range(20):  # ~20 MB: seconds of encoding
            f.write(sample_text() + "\n")
    out.write_text("previous complete output\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(
        [
            sys.executable,
            ENCODER_SCRIPT,
            "--encoder-json",
            str(gpt2_files[0]),
            "--vocab-bpe",
            str(gpt2_files[1]),
            "--inputs",
            str(big),
            "--outputs",
            str(out),
            "--keep-empty",
            "--workers",
            "2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    written = lambda: [p for p in tmp_path.glob(".out.bpe.*.part") if p.stat().st_size]  # noqa: E731
    signum, elapsed, stderr = interrupt_once(proc, sig, written, "the script")  # mid-run: text being written
    assert proc.returncode == 128 + signum and elapsed < 10, (proc.returncode, elapsed, stderr[-2000:])
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("processed ")]
    assert len(lines) == 1 and lines[0].startswith(f"multiprocessing_bpe_encoder.py: interrupted by {sig}"), stderr
    assert sorted(os.listdir(tmp_path)) == ["big.txt", "out.bpe"]
    assert out.read_text(encoding="utf-8") == "previous complete output\n"
    assert_group_gone(proc.pid)  # no worker outlived it


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    (d / "train.txt").write_text(sample_text(), encoding="utf-8")
    proc = run(
        os.path.join(ROOT, "scripts", "spm_train.py"),
        f"--input={d / 'train.txt'}",
        f"--model_prefix={d / 'spm'}",
        "--vocab_size=300",
        "--model_type=bpe",
        "--minloglevel=2",
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return d / "spm.model"


def test_spm_train_reports_trainer_errors(tmp_path):
    proc = run(
        os.path.join(ROOT, "scripts", "spm_train.py"),
        f"--input={tmp_path / 'none.txt'}",
        f"--model_prefix={tmp_path / 'm'}",
        "--vocab_size=100",
    )
    assert proc.returncode == 1 and "none.txt" in proc.stderr.decode() and "Traceback" not in proc.stderr.decode()
    assert run(os.path.join(ROOT, "scripts", "spm_train.py")).returncode == 2


def upstream_spm_output(sp, inputs, fmt, min_len=None, max_len=None):
    files = [open(p, "r", encoding="utf-8") for p in inputs]
    outs, empty, filtered = [[] for _ in inputs], 0, 0
    for lines in zip(*files):
        encoded = []
        for line in lines:
            line = line.strip()
            if not line:
                empty += 1
                encoded.append(None)
                continue
            toks = sp.EncodeAsPieces(line) if fmt == "piece" else list(map(str, sp.EncodeAsIds(line)))
            if (min_len is None or len(toks) >= min_len) and (max_len is None or len(toks) <= max_len):
                encoded.append(toks)
            else:
                filtered += 1
                encoded.append(None)
        if all(e is not None for e in encoded):
            for out, toks in zip(outs, encoded):
                out.append(" ".join(toks) + "\n")
    for f in files:
        f.close()
    return ["".join(o) for o in outs], empty, filtered


@pytest.mark.parametrize("fmt", ["piece", "id"])
def test_spm_encode_and_decode_match_upstream(tmp_path, spm_model, fmt):
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    lines = sample_text().split("\n")[:3000]
    a.write_text(AWKWARD + "\n" + "\n".join(lines) + "\n", encoding="utf-8")
    b.write_text("\n".join(reversed(lines)) + "\n", encoding="utf-8")
    want, empty, filtered = upstream_spm_output(sp, [a, b], fmt, min_len=2, max_len=40)
    oa, ob = tmp_path / "a.spm", tmp_path / "b.spm"
    proc = run(
        os.path.join(ROOT, "scripts", "spm_encode.py"),
        "--model",
        spm_model,
        "--output_format",
        fmt,
        "--inputs",
        a,
        b,
        "--outputs",
        oa,
        ob,
        "--min-len",
        "2",
        "--max-len",
        "40",
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert [oa.read_text(encoding="utf-8"), ob.read_text(encoding="utf-8")] == want
    assert f"skipped {empty} empty lines\nfiltered {filtered} lines\n" in proc.stderr.decode()
    assert empty > 0 and filtered > 0

    proc = run(
        os.path.join(ROOT, "scripts", "spm_decode.py"), "--model", spm_model, "--input", oa, "--input_format", fmt
    )
    assert proc.returncode == 0, proc.stderr.decode()
    decoded = proc.stdout.decode().split("\n")[:-1]
    if fmt == "piece":
        want_text = ["".join(sp.DecodePieces(line.rstrip().split())) for line in want[0].split("\n")[:-1]]
    else:
        want_text = [sp.DecodeIds([int(t) for t in line.split()]) for line in want[0].split("\n")[:-1]]
    assert decoded == want_text and len(decoded) == want[0].count("\n")


def test_spm_scripts_stdin_and_errors(tmp_path, spm_model):
    proc = run(os.path.join(ROOT, "scripts", "spm_encode.py"), "--model", spm_model, stdin=b"hello world\n\n")
    assert proc.returncode == 0 and proc.stdout.decode().startswith("\u2581")
    ids = tmp_path / "ids.txt"
    ids.write_text("5 6 <<unk>>\n1 2 99999\n", encoding="utf-8")
    proc = run(
        os.path.join(ROOT, "scripts", "spm_decode.py"), "--model", spm_model, "--input", ids, "--input_format", "id"
    )
    assert proc.returncode == 1 and "ids.txt, line 2: id 99999 is out of range" in proc.stderr.decode()
    ids.write_text("5 x\n", encoding="utf-8")
    proc = run(
        os.path.join(ROOT, "scripts", "spm_decode.py"), "--model", spm_model, "--input", ids, "--input_format", "id"
    )
    assert proc.returncode == 1 and "'x' is not an id" in proc.stderr.decode()
    proc = run(os.path.join(ROOT, "scripts", "spm_encode.py"), "--model", tmp_path / "none.model")
    assert proc.returncode == 1 and "none.model does not exist" in proc.stderr.decode()
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"junk")
    proc = run(os.path.join(ROOT, "scripts", "spm_decode.py"), "--model", junk, "--input", ids)
    assert proc.returncode == 1 and "could not be loaded" in proc.stderr.decode()


def test_readme_flow_raw_text_to_binarized_gpt2_ids(tmp_path, gpt2_files, encoder):
    """examples/large_lm/README.md: encode, write dict.txt listing the ids, fairseq-preprocess --srcdict."""
    from fairseq.data import Dictionary, MMapIndexedDataset
    from fairseq_cli.preprocess import cli_main

    lines = [line for line in sample_text().split("\n") if line.strip()][:400]
    raw = tmp_path / "train.raw"
    raw.write_text("\n".join(lines) + "\n", encoding="utf-8")
    bpe = tmp_path / "train.bpe"
    proc = run(
        ENCODER_SCRIPT,
        "--encoder-json",
        gpt2_files[0],
        "--vocab-bpe",
        gpt2_files[1],
        "--inputs",
        raw,
        "--outputs",
        bpe,
        "--keep-empty",
        "--workers",
        "2",
    )
    assert proc.returncode == 0, proc.stderr.decode()
    ids = sorted(json.loads(gpt2_files[0].read_text(encoding="utf-8")).values())
    target = 4 + len(ids) + (-(4 + len(ids)) % 8)  # the README's rule: 4 specials + ids, padded to 8
    with open(tmp_path / "dict.txt", "w", encoding="utf-8") as f:
        f.writelines(f"{i} 1\n" for i in ids)
        f.writelines(f"madeupword{k:04d} 0\n" for k in range(target - 4 - len(ids)))
    cli_main(
        [
            "--only-source",
            "--srcdict",
            str(tmp_path / "dict.txt"),
            "--trainpref",
            str(bpe),
            "--destdir",
            str(tmp_path / "bin"),
            "--workers",
            "1",
        ]
    )
    d = Dictionary.load(str(tmp_path / "bin" / "dict.txt"))
    assert len(d) == target and target % 8 == 0
    data = MMapIndexedDataset(str(tmp_path / "bin" / "train"))
    assert len(data) == len(lines)
    for k in (0, 7, len(lines) - 1):
        item = data[k].tolist()
        assert item[-1] == d.eos()
        assert [int(d[i]) for i in item[:-1]] == encoder.encode(lines[k].strip())
        assert encoder.decode([int(d[i]) for i in item[:-1]]) == lines[k].strip()


def test_benchmark_bpe_prints_its_table(tmp_path):
    pytest.importorskip("regex")
    proc = run(
        os.path.join(ROOT, "scripts", "benchmark_bpe.py"),
        "--sizes-mb",
        "0.05",
        "0.1",
        "--workers",
        "2",
        "--vocab-size",
        "600",
        "--bpe-train-mb",
        "0.05",
        "--workdir",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode()
    assert "| 0.1 | multiprocessing_bpe_encoder.py (tiktoken) | 2 |" in out
    assert "| 0.1 | pure-Python reference, upstream's script | 2 |" in out
    assert out.count("outputs identical") == 2


@pytest.mark.parametrize("script", ["bpe", "spm"])
def test_unwritable_output_is_one_line_naming_it(gpt2_files, spm_model, tmp_path, script):
    """An output that cannot be written (here a file-size limit, which stops root too; a read-only directory
    fails the same way) is one line naming the output, the errno and the fix; an earlier output is intact and
    no temporary file is left."""
    text = tmp_path / "in.raw"
    text.write_text(sample_text(), encoding="utf-8")
    out = tmp_path / "out.txt"
    out.write_text("earlier\n")
    cmd = (
        (ENCODER_SCRIPT, "--encoder-json", gpt2_files[0], "--vocab-bpe", gpt2_files[1], "--workers", "1")
        if script == "bpe"
        else (os.path.join(ROOT, "scripts", "spm_encode.py"), "--model", spm_model)
    )
    proc = run(*cmd, "--inputs", text, "--outputs", out, max_file_size=1000)
    stderr = proc.stderr.decode()
    name = os.path.basename(cmd[0])
    assert proc.returncode == 1 and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith(f"{name}: error: cannot write {out}: File too large (EFBIG). Fix: "), stderr
    assert out.read_text() == "earlier\n" and sorted(os.listdir(tmp_path)) == ["in.raw", "out.txt"]


def test_train_gpt2_bpe_unwritable_outdir_is_one_line(tmp_path):
    text = tmp_path / "in.raw"
    text.write_text(sample_text(), encoding="utf-8")
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    script = os.path.join(ROOT, "scripts", "train_gpt2_bpe.py")
    for outdir, code, limit in (
        (blocker / "bpe", "ENOTDIR", None),
        (blocker, "EEXIST", None),
        (tmp_path / "bpe", "EFBIG", 1000),
    ):
        proc = run(script, "--vocab-size", 300, "--outdir", outdir, text, max_file_size=limit)
        stderr = proc.stderr.decode()
        assert proc.returncode == 1 and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
        assert (
            stderr.startswith(f"train_gpt2_bpe.py: error: cannot write {outdir}: ") and f"({code}). Fix: " in stderr
        ), stderr
