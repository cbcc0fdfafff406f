"""What a hostile-but-realistic user does to a --save-dir, through the real fairseq-train entry point:
aliases edited in place, a full disk, an unwritable directory, two runs at once, killed saves, damaged files,
another dictionary, changed model options."""

import os
import resource
import subprocess
import sys

import pytest
import torch

from fairseq.checkpoint.io import (
    CheckpointError,
    CorruptCheckpointError,
    atomic_torch_save,
    default_file_mode,
    load_checkpoint_file,
)
from fairseq.checkpoint.save_dir import LOCK_FILE, SaveDirInUse, SaveDirLock
from fairseq.checkpoint.sharded import copy_sharded
from fairseq_cli import train
from tests.train_fixtures import train_in_process


@pytest.fixture(scope="module")
def train_args(build_train_args):
    """This file's runs: the tiny transformer_lm with no schedule, dropout or --log-file, 4 updates by default."""

    def args(data, save_dir, *extra, max_update=4):
        return build_train_args(
            data, save_dir, "--sample-break-mode", "none", *extra, max_update=max_update, log_file=False
        )

    return args


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def num_updates(path):
    return load(path)["extra_state"]["trainer"]["num_updates"]


def run_cli(args, limit_file_size=None):
    """fairseq-train in a subprocess, under a file-size limit if given (writes past it fail with EFBIG; the
    limit is the process's, hence the subprocess)."""

    def limit():
        if limit_file_size is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_size, limit_file_size))

    code = "import sys; from fairseq_cli.train import console_main; sys.argv[0] = 'fairseq-train'; console_main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, preexec_fn=limit
    )


# ----------------------------------------------------------------------------- aliases are independent


def test_checkpoint_names_are_independent_files(tiny_data, tmp_path, train_args):
    train.cli_main(train_args(tiny_data, tmp_path, "--save-interval-updates", "2", max_update=4))
    names = ["checkpoint_1_4.pt", "checkpoint_best.pt", "checkpoint_last.pt"]
    inodes = {os.stat(tmp_path / n).st_ino for n in names}
    assert len(inodes) == 3 and all(os.stat(tmp_path / n).st_nlink == 1 for n in names)
    assert open(tmp_path / "checkpoint_1_4.pt", "rb").read() == open(tmp_path / "checkpoint_last.pt", "rb").read()

    # Strip the optimizer state from checkpoint_best in place (torch.save to the same path truncates and
    # rewrites the file): the other names keep theirs.
    best = load(tmp_path / "checkpoint_best.pt")
    del best["last_optimizer_state"]
    with open(tmp_path / "checkpoint_best.pt", "r+b") as f:
        f.truncate(0)
        torch.save(best, f)
    assert "last_optimizer_state" in load(tmp_path / "checkpoint_last.pt")
    assert "last_optimizer_state" in load(tmp_path / "checkpoint_1_4.pt")

    # Roll back by copying an older checkpoint over checkpoint_last: the newest interval checkpoint is untouched.
    before = open(tmp_path / "checkpoint_1_4.pt", "rb").read()
    with open(tmp_path / "checkpoint_1_2.pt", "rb") as src, open(tmp_path / "checkpoint_last.pt", "r+b") as dst:
        dst.truncate(0)
        dst.write(src.read())
    assert num_updates(tmp_path / "checkpoint_last.pt") == 2
    assert open(tmp_path / "checkpoint_1_4.pt", "rb").read() == before


def test_sharded_copy_is_independent(tmp_path):
    src, dst = tmp_path / "checkpoint_1_4", tmp_path / "checkpoint_last"
    src.mkdir()
    for name, data in [(".metadata", b"m" * 100), ("__0_0.distcp", b"x" * 5000), ("metadata.pt", b"p" * 10)]:
        (src / name).write_bytes(data)
    copy_sharded(str(src), str(dst))  # no process group: one rank copies every file
    for name in os.listdir(src):
        assert (dst / name).read_bytes() == (src / name).read_bytes()
        assert os.stat(dst / name).st_ino != os.stat(src / name).st_ino
    with open(dst / "__0_0.distcp", "r+b") as f:
        f.write(b"changed")
    assert (src / "__0_0.distcp").read_bytes() == b"x" * 5000
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1_4", "checkpoint_last"]  # no temporaries left


def test_checkpoint_files_get_the_ordinary_file_mode(tmp_path):
    path = tmp_path / "c.pt"
    atomic_torch_save({"x": torch.ones(2)}, str(path))
    assert os.stat(path).st_mode & 0o777 == default_file_mode()


# ----------------------------------------------------------------------------- failed writes


def test_disk_full_during_save_is_one_line_and_keeps_the_previous_checkpoint(tiny_data, tmp_path, train_args):
    assert train.cli_main(train_args(tiny_data, tmp_path, max_update=1)) is None
    before = open(tmp_path / "checkpoint_last.pt", "rb").read()
    # A file-size limit below the checkpoint's size: the save fails with EFBIG as it would with ENOSPC.
    result = run_cli(train_args(tiny_data, tmp_path, max_update=2), limit_file_size=len(before) // 2)
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "EFBIG" in errors[0] and str(tmp_path) in errors[0], result.stderr[-2000:]
    assert "previously at that path is intact" in errors[0]
    assert "Traceback" not in result.stderr and "unexpected pos" not in result.stderr
    assert open(tmp_path / "checkpoint_last.pt", "rb").read() == before
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_unwritable_save_dir_fails_at_start_up(tiny_data, tmp_path, train_args):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    returncode, stdout, stderr = train_in_process(train_args(tiny_data, blocker / "ckpt"))
    assert returncode == 1
    assert "--save-dir is not writable" in stderr and "ENOTDIR" in stderr, stderr[-2000:]
    assert "num. model params" not in stdout + stderr  # found before the model is built, not at the first save
    assert "Traceback" not in stderr


def test_full_disk_is_found_at_start_up(tiny_data, tmp_path, train_args):
    result = run_cli(train_args(tiny_data, tmp_path / "ckpt"), limit_file_size=100)  # the probe writes 1.2 kB
    assert result.returncode == 1
    assert "--save-dir is not writable" in result.stderr and "EFBIG" in result.stderr, result.stderr[-2000:]


# ----------------------------------------------------------------------------- one run per directory


def test_second_run_on_a_locked_save_dir_fails_naming_the_holder(tiny_data, tmp_path, train_args):
    lock = SaveDirLock(str(tmp_path))
    lock.acquire()  # stands for another run's rank 0
    try:
        with pytest.raises(SaveDirInUse, match=rf"in use by another training run \(pid {os.getpid()} on host"):
            train.cli_main(train_args(tiny_data, tmp_path))
        assert not os.path.exists(tmp_path / "checkpoint_last.pt")
    finally:
        lock.release()
    train.cli_main(train_args(tiny_data, tmp_path, max_update=1))  # free again once the holder is gone
    assert num_updates(tmp_path / "checkpoint_last.pt") == 1
    train.cli_main(train_args(tiny_data, tmp_path, max_update=2))  # a finished run released it
    assert os.path.exists(tmp_path / LOCK_FILE)


def test_lock_is_released_when_the_holder_is_killed(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from fairseq.checkpoint.save_dir import SaveDirLock; "
            f"SaveDirLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(SaveDirInUse, match=f"pid {holder.pid}"):
        SaveDirLock(str(tmp_path)).acquire()
    holder.kill()
    holder.wait()
    lock = SaveDirLock(str(tmp_path))
    lock.acquire()
    lock.release()


def test_temporaries_of_killed_saves_are_removed_at_start(tiny_data, tmp_path, train_args):
    (tmp_path / ".checkpoint_last.pt.k2j3.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / "checkpoint_last.tmp").mkdir()
    (tmp_path / "checkpoint_last.tmp" / "__0_0.distcp").write_bytes(b"half a shard")
    train.cli_main(train_args(tiny_data, tmp_path, max_update=1))
    assert sorted(n for n in os.listdir(tmp_path) if "tmp" in n) == []


def test_temporaries_are_removed_before_the_write_probe(tiny_data, tmp_path, train_args):
    """On a full disk the temporaries of a killed save may be what fills it: they go before the probe writes."""
    (tmp_path / ".checkpoint_last.pt.k2j3.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / "checkpoint_last.tmp").mkdir()
    (tmp_path / "checkpoint_last.tmp" / "__0_0.distcp").write_bytes(b"half a shard")
    result = run_cli(train_args(tiny_data, tmp_path), limit_file_size=500)  # the probe writes 1.2 kB
    assert result.returncode == 1
    assert "--save-dir is not writable" in result.stderr and "EFBIG" in result.stderr, result.stderr[-2000:]
    assert sorted(n for n in os.listdir(tmp_path) if "tmp" in n) == []


# ----------------------------------------------------------------------------- sharded checkpoints


@pytest.fixture(scope="module")
def sharded_run(tiny_data, tmp_path_factory, build_train_args):
    """(save dir holding checkpoint_1_1, checkpoint_1_2 and checkpoint_last as sharded directories, argv(save_dir,
    max_update)); tests copy the directory."""

    def argv(save_dir, max_update):
        return build_train_args(
            tiny_data,
            save_dir,
            "--disable-validation",
            "--ddp-backend",
            "fully_sharded",
            "--use-sharded-state",
            "--save-interval-updates",
            "1",
            max_update=max_update,
            arch="transformer_lm_gpt",
            seed="5",
            json_log=False,
            log_file=False,
        )

    save_dir = tmp_path_factory.mktemp("sharded")
    status, stdout, stderr = train_in_process(argv(save_dir, 2))
    assert status == 0, stdout[-2000:] + stderr[-2000:]
    return save_dir, argv


def copy_of(sharded_run, tmp_path):
    import shutil

    save_dir = tmp_path / "ckpt"
    shutil.copytree(sharded_run[0], save_dir)
    return save_dir


def files_of(directory):
    return {name: (directory / name).read_bytes() for name in os.listdir(directory)}


def test_sharded_save_over_a_file_size_limit_is_one_line_and_leaves_no_temporary(sharded_run, tmp_path):
    save_dir = copy_of(sharded_run, tmp_path)
    before = files_of(save_dir / "checkpoint_last")
    shard = max(len(data) for data in before.values())
    result = run_cli(sharded_run[1](save_dir, 3), limit_file_size=shard // 2)
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "EFBIG" in errors[0] and str(save_dir / "checkpoint_1_3") in errors[0], errors
    assert "Traceback" not in result.stderr
    assert files_of(save_dir / "checkpoint_last") == before
    assert not [n for n in os.listdir(save_dir) if n.endswith(".tmp")]


def test_garbage_sharded_index_names_the_intact_ones_to_restore(sharded_run, tmp_path):
    save_dir = copy_of(sharded_run, tmp_path)
    (save_dir / "checkpoint_last" / ".metadata").write_bytes(b"\x80\x04garbage, not an index" * 40)
    status, stdout, stderr = train_in_process(sharded_run[1](save_dir, 3))
    errors = stderr.strip().splitlines()
    assert status == 1 and len(errors) == 1, stderr[-2000:]
    message = errors[0]
    assert str(save_dir / "checkpoint_last" / ".metadata") in message and "damaged" in message
    listed = message.split("the most trained first: ")[1].split(";")[0].split(", ")
    assert sorted(listed) == ["checkpoint_1_1", "checkpoint_1_2"]
    assert "--restore-file checkpoint_1_2" in message


# ----------------------------------------------------------------------------- damaged checkpoints


def test_garbage_legacy_and_truncated_files_are_told_apart(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(os.urandom(4096).replace(b"PK", b"pk").lstrip(b"\x80") or b"x")
    with pytest.raises(CheckpointError, match="is not a checkpoint") as info:
        load_checkpoint_file(str(garbage))
    assert "--trust-legacy-checkpoint" not in str(info.value)
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        load_checkpoint_file(str(garbage), trust_legacy=True)

    good = tmp_path / "good.pt"
    atomic_torch_save({"model": {"w": torch.zeros(5000)}}, str(good))
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        load_checkpoint_file(str(truncated))

    import argparse

    legacy = tmp_path / "legacy.pt"
    torch.save({"args": argparse.Namespace(arch="x"), "model": {}}, str(legacy))
    with pytest.raises(CheckpointError, match="--trust-legacy-checkpoint") as info:
        load_checkpoint_file(str(legacy))
    assert not isinstance(info.value, CorruptCheckpointError)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_checkpoint_last_names_the_intact_ones_to_restore(tiny_data, tmp_path, train_args, damage):
    train.cli_main(train_args(tiny_data, tmp_path, "--save-interval-updates", "2", max_update=4))
    last = tmp_path / "checkpoint_last.pt"
    last.write_bytes(last.read_bytes()[:1000] if damage == "truncated" else b"garbage, not a checkpoint" * 40)
    with pytest.raises(CheckpointError) as info:
        train.cli_main(train_args(tiny_data, tmp_path, "--save-interval-updates", "2", max_update=6))
    message = str(info.value)
    said = "truncated" if damage == "truncated" else "is not a checkpoint"
    assert said in message and "checkpoint_last.pt" in message
    listed = message.split("the most trained first: ")[1].split(";")[0].split(", ")
    assert sorted(listed) == ["checkpoint_1_2.pt", "checkpoint_1_4.pt", "checkpoint_best.pt"]
    assert listed[-1] == "checkpoint_1_2.pt"  # the oldest last
    suggested = message.split("--restore-file ")[1]
    assert suggested in ("checkpoint_1_4.pt", "checkpoint_best.pt")  # both hold update 4
    train.cli_main(
        train_args(tiny_data, tmp_path, "--save-interval-updates", "2", "--restore-file", suggested, max_update=6)
    )
    assert num_updates(last) == 6


def test_intact_checkpoints_are_listed_by_training_progress_not_modification_time(tiny_data, tmp_path, train_args):
    """A `touch` of an old checkpoint (or a `cp -r` of the directory) must not make it the recommended one."""
    train.cli_main(train_args(tiny_data, tmp_path, "--save-interval-updates", "2", max_update=4))
    (tmp_path / "checkpoint_last.pt").write_bytes(b"garbage, not a checkpoint" * 40)
    future = os.path.getmtime(tmp_path / "checkpoint_1_4.pt") + 3600
    os.utime(tmp_path / "checkpoint_1_2.pt", (future, future))  # the oldest now looks the newest
    with pytest.raises(CheckpointError) as info:
        train.cli_main(train_args(tiny_data, tmp_path, "--save-interval-updates", "2", max_update=6))
    message = str(info.value)
    listed = message.split("the most trained first: ")[1].split(";")[0].split(", ")
    assert listed == ["checkpoint_1_4.pt", "checkpoint_best.pt", "checkpoint_1_2.pt"], message  # ties by name
    assert message.endswith("--restore-file checkpoint_1_4.pt")


# ----------------------------------------------------------------------------- mismatches named as such


def test_dictionary_that_does_not_match_the_checkpoint_is_named(tiny_data, tmp_path, train_args):
    save = tmp_path / "ckpt"
    train.cli_main(train_args(tiny_data, save, max_update=1))
    other = tmp_path / "other-data"
    other.mkdir()
    for name in os.listdir(tiny_data):
        os.symlink(os.path.join(tiny_data, name), other / name)
    os.remove(other / "dict.txt")
    with open(os.path.join(tiny_data, "dict.txt")) as f:
        lines = f.readlines()
    (other / "dict.txt").write_text("".join(lines) + "".join(f"extra{i} 1\n" for i in range(8)))
    with pytest.raises(CheckpointError, match="dictionary does not match the checkpoint") as info:
        train.cli_main(train_args(other, save, max_update=2))
    assert "different architecture" not in str(info.value)


@pytest.mark.parametrize(
    "flag,value",
    [("--decoder-attention-heads", "4"), ("--decoder-ffn-embed-dim", "128"), ("--tokens-per-sample", "16")],
)
def test_changed_model_option_on_resume_is_refused_naming_it(tiny_data, tmp_path, flag, value, train_args):
    train.cli_main(train_args(tiny_data, tmp_path, max_update=1))
    args = train_args(tiny_data, tmp_path, max_update=2)
    args[args.index(flag) + 1] = value
    named = "--max-target-positions" if flag == "--tokens-per-sample" else flag
    with pytest.raises(CheckpointError, match=named):
        train.cli_main(args)
    assert num_updates(tmp_path / "checkpoint_last.pt") == 1


@pytest.mark.parametrize(
    "first,then,fix,fixed",
    [
        # another --arch preset (pre-norm, gelu, learned positions): the fix is the checkpoint's --arch
        (
            [],
            ["--arch", "transformer_lm_gpt"],
            "Resume with --arch transformer_lm (the checkpoint's; this run has --arch transformer_lm_gpt)",
            [],
        ),
        # boolean options are store_true flags: "--decoder-normalize-before False" is no command line
        (["--decoder-normalize-before"], [], "Resume with --decoder-normalize-before,", ["--decoder-normalize-before"]),
        ([], ["--decoder-normalize-before"], "Resume without --decoder-normalize-before,", []),
        ([], ["--activation-fn", "gelu"], "Resume with --activation-fn relu,", ["--activation-fn", "relu"]),
    ],
)
def test_changed_model_option_on_resume_names_a_fix_the_parser_accepts(
    tiny_data, tmp_path, train_args, first, then, fix, fixed
):
    train.cli_main(train_args(tiny_data, tmp_path, *first, max_update=1))
    with pytest.raises(CheckpointError) as info:
        train.cli_main(train_args(tiny_data, tmp_path, *then, max_update=2))  # the last --arch counts
    assert fix in str(info.value), str(info.value)
    assert num_updates(tmp_path / "checkpoint_last.pt") == 1
    train.cli_main(train_args(tiny_data, tmp_path, *fixed, max_update=2))  # the fix as told resumes
    assert num_updates(tmp_path / "checkpoint_last.pt") == 2


def test_checkpoint_with_the_embed_dim_as_input_and_output_dims_resumes_with_them_named(
    tiny_data, tmp_path, train_args
):
    """A bare transformer_lm run saved while unset input/output dims followed the embed dim (2026-12-04 to -06)
    stored 32 for both: the same command line now means 512 (upstream's default), and resuming names the flags
    that give the checkpoint's model back."""
    args = train_args(tiny_data, tmp_path, max_update=1)  # --decoder-input-dim 32 --decoder-output-dim 32
    train.cli_main(args)
    for flag in ("--decoder-input-dim", "--decoder-output-dim"):
        del args[args.index(flag) : args.index(flag) + 2]
    args[args.index("--max-update") + 1] = "2"
    with pytest.raises(CheckpointError) as info:
        train.cli_main(args)
    assert "--decoder-input-dim is 512 here but 32 in the checkpoint" in str(info.value)
    assert "Resume with --decoder-input-dim 32," in str(info.value)
    assert num_updates(tmp_path / "checkpoint_last.pt") == 1
