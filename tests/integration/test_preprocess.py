"""fairseq-preprocess end to end: the real CLI code on the sample corpus and on hand-made inputs."""

import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fairseq.data import Dictionary, MMapIndexedDataset
from fairseq_cli import preprocess
from tests.train_fixtures import assert_group_gone, console_in_process, interrupt_once

REPO = Path(__file__).resolve().parents[2]
CLI = shutil.which("fairseq-preprocess", path=os.path.dirname(sys.executable)) or "fairseq-preprocess"


def run_main(*argv):
    preprocess.main(preprocess.parse_args([str(a) for a in argv]))


def files_of(dest):
    return {p.name: p.read_bytes() for p in sorted(Path(dest).iterdir()) if p.name != "preprocess.log"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    subprocess.run(
        [sys.executable, str(REPO / "examples/language_model/prepare_sample_corpus.py"), str(out)],
        check=True,
        capture_output=True,
    )
    return out


def corpus_args(corpus, dest, workers, *extra):
    return [
        "--only-source",
        "--trainpref",
        corpus / "train.txt",
        "--validpref",
        f"{corpus / 'valid.txt'},{corpus / 'test.txt'}",
        "--testpref",
        corpus / "test.txt",
        "--destdir",
        dest,
        "--workers",
        workers,
        *extra,
    ]


def test_workers_1_and_2_give_identical_files(corpus, tmp_path):
    run_main(*corpus_args(corpus, tmp_path / "w1", 1))
    run_main(*corpus_args(corpus, tmp_path / "w2", 2))
    one, two = files_of(tmp_path / "w1"), files_of(tmp_path / "w2")
    assert sorted(one) == [
        "dict.txt",
        "test.bin",
        "test.idx",
        "train.bin",
        "train.idx",
        "valid.bin",
        "valid.idx",
        "valid1.bin",
        "valid1.idx",
    ]
    assert one == two


def test_output_reads_back_token_for_token(corpus, tmp_path):
    run_main(*corpus_args(corpus, tmp_path / "d", 2))
    d = Dictionary.load(str(tmp_path / "d" / "dict.txt"))
    assert len(d) % 8 == 0
    for split, text in (("train", "train.txt"), ("valid", "valid.txt"), ("valid1", "test.txt")):
        ds = MMapIndexedDataset(str(tmp_path / "d" / split))
        with open(corpus / text, encoding="utf-8") as f:
            lines = f.readlines()
        assert len(ds) == len(lines)
        for i, line in enumerate(lines):
            assert ds[i].tolist() == d.encode_line(line).tolist()


def test_dictionary_holds_every_train_word_with_its_count(corpus, tmp_path):
    run_main("--only-source", "--trainpref", corpus / "train.txt", "--destdir", tmp_path, "--dict-only")
    assert sorted(os.listdir(tmp_path)) == ["dict.txt", "preprocess.log"]
    counts = {}
    with open(corpus / "train.txt", encoding="utf-8") as f:
        for line in f:
            for w in line.split():
                counts[w] = counts.get(w, 0) + 1
    d = Dictionary.load(str(tmp_path / "dict.txt"))
    got = {s: c for s, c in zip(d.symbols[4:], d.count[4:]) if not s.startswith("madeupword")}
    assert got == counts
    assert d.count[4 : len(counts) + 4] == sorted(counts.values(), reverse=True)


def test_srcdict_reuse_gives_identical_data(corpus, tmp_path):
    run_main(*corpus_args(corpus, tmp_path / "built", 1))
    run_main(*corpus_args(corpus, tmp_path / "reused", 2, "--srcdict", tmp_path / "built" / "dict.txt"))
    assert files_of(tmp_path / "built") == files_of(tmp_path / "reused")


def test_byte_exact_output_for_a_tiny_corpus(tmp_path):
    (tmp_path / "train.txt").write_text("b a\nc a b\n\na\n", encoding="utf-8")
    run_main("--only-source", "--trainpref", tmp_path / "train.txt", "--destdir", tmp_path / "out")
    # counts: a 3, b 2, c 1 -> ids a=4, b=5, c=6; 4 specials + 3 words padded to 8 with madeupword0000
    assert (tmp_path / "out" / "dict.txt").read_text() == "a 3\nb 2\nc 1\nmadeupword0000 0\n"
    ids = [5, 4, 2, 6, 4, 5, 2, 2, 4, 2]
    sizes = [3, 4, 1, 2]
    pointers = [0, 6, 14, 16]
    expected_idx = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", 8)
        + struct.pack("<Q", 4)
        + struct.pack("<4i", *sizes)
        + struct.pack("<4q", *pointers)
    )
    assert (tmp_path / "out" / "train.idx").read_bytes() == expected_idx
    assert (tmp_path / "out" / "train.bin").read_bytes() == struct.pack("<10H", *ids)


def test_preprocess_log_has_upstream_lines(tmp_path):
    (tmp_path / "train.txt").write_text("a b\nc\n", encoding="utf-8")
    (tmp_path / "valid.txt").write_text("a zz\n", encoding="utf-8")
    run_main(
        "--only-source",
        "--trainpref",
        tmp_path / "train.txt",
        "--validpref",
        tmp_path / "valid.txt",
        "--destdir",
        tmp_path / "out",
    )
    lines = (tmp_path / "out" / "preprocess.log").read_text().splitlines()
    assert lines[0].startswith("Namespace(")
    assert lines[1:] == [
        "[None] Dictionary: 8 types",
        f"[None] {tmp_path / 'train.txt'}: 2 sents, 5 tokens, 0.0% replaced (by <unk>)",
        "[None] Dictionary: 8 types",
        f"[None] {tmp_path / 'valid.txt'}: 1 sents, 3 tokens, 33.3% replaced (by <unk>)",
        f"Wrote preprocessed data to {tmp_path / 'out'}",
    ]


def test_thresholdsrc_and_nwordssrc(tmp_path):
    (tmp_path / "train.txt").write_text("a a a b b c\n", encoding="utf-8")
    run_main(
        "--only-source",
        "--trainpref",
        tmp_path / "train.txt",
        "--destdir",
        tmp_path / "t",
        "--thresholdsrc",
        2,
        "--padding-factor",
        1,
    )
    assert (tmp_path / "t" / "dict.txt").read_text() == "a 3\nb 2\n"
    assert MMapIndexedDataset(str(tmp_path / "t" / "train"))[0].tolist() == [4, 4, 4, 5, 5, 3, 2]
    run_main(
        "--only-source",
        "--trainpref",
        tmp_path / "train.txt",
        "--destdir",
        tmp_path / "n",
        "--nwordssrc",
        5,
        "--padding-factor",
        1,
    )
    assert (tmp_path / "n" / "dict.txt").read_text() == "a 3\n"


def test_without_only_source_is_refused(tmp_path):
    (tmp_path / "train.txt").write_text("a\n")
    with pytest.raises(preprocess.PreprocessError, match="pass --only-source"):
        run_main("--trainpref", tmp_path / "train.txt", "--destdir", tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_missing_input_is_named_before_anything_is_written(tmp_path):
    (tmp_path / "train.txt").write_text("a\n")
    with pytest.raises(preprocess.PreprocessError, match=r"input file .*nope\.txt does not exist"):
        run_main(
            "--only-source",
            "--trainpref",
            tmp_path / "train.txt",
            "--validpref",
            tmp_path / "nope.txt",
            "--destdir",
            tmp_path / "o",
        )
    assert not (tmp_path / "o").exists()


def test_installed_cli_reports_errors_with_exit_status(tmp_path):
    r = subprocess.run(
        [CLI, "--only-source", "--trainpref", str(tmp_path / "missing.txt"), "--destdir", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert f"input file {tmp_path / 'missing.txt'} does not exist" in r.stderr


def test_installed_cli_runs(corpus, tmp_path):
    r = subprocess.run([CLI, *map(str, corpus_args(corpus, tmp_path / "cli", 2))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "train.txt: 2086 sents" in r.stdout
    run_main(*corpus_args(corpus, tmp_path / "inproc", 1))
    assert files_of(tmp_path / "cli") == files_of(tmp_path / "inproc")


@pytest.fixture(scope="module")
def big(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "big.txt"
    chunk = (corpus / "train.txt").read_bytes()
    with open(path, "wb") as f:
        for _ in range(60):  # ~23 MB: takes seconds, so a kill or signal lands mid-binarization
            f.write(chunk)
    return path


def part_file_written(dest):
    return any(p.name.endswith(".bin.part") for p in dest.glob(".*"))


def wait_for_part_file(proc, dest):
    deadline = time.time() + 60
    while time.time() < deadline and not part_file_written(dest):
        time.sleep(0.002)
    assert proc.poll() is None, "preprocess finished before it could be interrupted"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_one_signal_ends_the_run_promptly_and_removes_its_temporaries(corpus, big, tmp_path, sig):
    """Ctrl-C (SIGINT to the whole process group, workers included) or SIGTERM to the main process, once:
    the run and its workers end within seconds with one line and 128 + the signal's number; no hidden file is
    left and the outputs of an earlier run not yet replaced are intact."""
    dest = tmp_path / "out"
    run_main("--only-source", "--trainpref", corpus / "valid.txt", "--destdir", dest, "--workers", "1")
    before = {name: (dest / name).read_bytes() for name in ("train.bin", "train.idx")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fairseq_cli.preprocess",
            "--only-source",
            "--trainpref",
            str(big),
            "--destdir",
            str(dest),
            "--workers",
            "2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    signum, elapsed, stderr = interrupt_once(proc, sig, lambda: part_file_written(dest), "preprocess")
    assert proc.returncode == 128 + signum and elapsed < 10, (proc.returncode, elapsed, stderr[-2000:])
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fairseq-preprocess: interrupted by {sig}"), stderr[-2000:]
    assert sorted(p.name for p in dest.iterdir()) == ["dict.txt", "preprocess.log", "train.bin", "train.idx"]
    assert {name: (dest / name).read_bytes() for name in before} == before
    assert_group_gone(proc.pid)  # no worker outlived it


@pytest.mark.parametrize("how", ["under a file", "is a file", "file-size limit"])
def test_unwritable_destdir_is_one_line_naming_the_path_and_errno(corpus, tmp_path, how):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    dest = {"under a file": blocker / "out", "is a file": blocker, "file-size limit": tmp_path / "out"}[how]
    argv = ["--only-source", "--trainpref", str(corpus / "train.txt"), "--destdir", str(dest), "--workers", "2"]
    limit = 100_000 if how == "file-size limit" else None  # dict.txt (35 kB) fits, train.bin (184 kB) does not

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    if limit is None:  # the command's entry point in this process
        returncode, _, stderr = console_in_process("fairseq-preprocess", preprocess.cli_main, argv)
    else:  # the limit is a process's: a process of its own
        r = subprocess.run(
            [sys.executable, "-m", "fairseq_cli.preprocess", *argv],
            capture_output=True,
            text=True,
            preexec_fn=limit_file_size,
            timeout=120,
        )
        returncode, stderr = r.returncode, r.stderr
    lines = stderr.strip().splitlines()
    assert returncode == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
    path, code = {
        "under a file": (dest, "ENOTDIR"),
        "is a file": (dest, "EEXIST"),
        "file-size limit": (dest / "train.bin", "EFBIG"),
    }[how]
    assert lines[0].startswith(f"fairseq-preprocess: error: cannot write {path}: ") and f"({code})" in lines[0]
    if how == "file-size limit":
        assert sorted(p.name for p in dest.iterdir()) == ["dict.txt", "preprocess.log"]


def test_killed_run_leaves_no_dataset(big, tmp_path):
    dest = tmp_path / "out"
    proc = subprocess.Popen(
        [CLI, "--only-source", "--trainpref", str(big), "--destdir", str(dest), "--workers", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_part_file(proc, dest)
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its worker processes
    finally:
        proc.wait()
    assert not MMapIndexedDataset.exists(str(dest / "train"))
    assert not [p for p in dest.iterdir() if p.suffix in (".bin", ".idx")]


def forkserver_started(pid):
    """Whether multiprocessing's forkserver, a child of `pid`, has started (it then imports torch: seconds)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if (
                stat.read_text().rsplit(")", 1)[1].split()[1] == str(pid)
                and b"multiprocessing.forkserver" in (stat.parent / "cmdline").read_bytes()
            ):
                return True
        except (OSError, IndexError):
            continue
    return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the forkserver through /proc")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0.05, 0.5])
def test_ctrl_c_while_the_workers_start_is_one_line_and_prompt(big, tmp_path, delay):
    """Ctrl-C while the workers' forkserver imports its modules: only this process reports it (the forkserver
    starts with SIGINT blocked and then ignores it), at once; preprocess.log holds the arguments line first, as
    upstream's (never an empty file)."""
    dest = tmp_path / "out"
    proc = subprocess.Popen(
        [CLI, "--only-source", "--trainpref", str(big), "--destdir", str(dest), "--workers", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    started = []

    def forkserver_importing():
        if not started and forkserver_started(proc.pid):
            started.append(time.time())
        return bool(started) and time.time() - started[0] >= delay

    try:
        deadline = time.time() + 60
        while time.time() < deadline and not forkserver_importing():
            time.sleep(0.002)
        assert proc.poll() is None, "preprocess finished before it could be interrupted"
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C: the whole group, forkserver included
        sent = time.time()
        while proc.poll() is None and time.time() - sent < 30:
            time.sleep(0.005)
        elapsed = time.time() - sent  # the command itself (the shell's prompt is back then)
        stderr = proc.stderr.read()  # (end of file once the forkserver, which shares stderr, is gone too)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and elapsed < 3, (proc.returncode, elapsed, stderr[-2000:])
    assert stderr.strip().splitlines() == [
        "fairseq-preprocess: interrupted by SIGINT; temporary files removed, files written before are intact"
    ], stderr[-3000:]
    assert sorted(p.name for p in dest.iterdir()) == ["preprocess.log"]
    assert (dest / "preprocess.log").read_text().startswith("Namespace(")
    assert_group_gone(proc.pid)  # the forkserver too (it ends once it sees this process gone)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="sees torch loaded through /proc")
@pytest.mark.timeout(120)
def test_ctrl_c_while_the_command_imports_torch_is_one_line(big, tmp_path):
    """Ctrl-C before the command's main runs (torch's import takes seconds): one line, not the import's
    traceback, and the status of a death by SIGINT (fairseq_cli's exception hook)."""
    proc = subprocess.Popen(
        [CLI, "--only-source", "--trainpref", str(big), "--destdir", str(tmp_path / "out")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    maps = Path(f"/proc/{proc.pid}/maps")
    try:
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None and "libtorch" not in maps.read_text():
            time.sleep(0.002)  # fairseq_cli (the hook) is imported before anything loads torch
        assert proc.poll() is None, "preprocess finished before it could be interrupted"
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode in (-signal.SIGINT, 130), (proc.returncode, stderr[-2000:])
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.startswith("fairseq-preprocess: interrupted by SIGINT"), stderr
