"""fairseq.checkpoint.io: atomic saves (also when killed mid-write), atomic copies, safe loading."""

import argparse
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from fairseq.checkpoint.io import CheckpointError, atomic_copy, atomic_torch_save, load_checkpoint_file
from fairseq.checkpoint.paths import existing_checkpoint, prune_checkpoints
from fairseq.dataclass.configs import CheckpointConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def small_state(value=1.0):
    return {
        "model": {"w": torch.full((3, 4), value), "b": torch.arange(5)},
        "extra_state": {"epoch": 2, "best": None, "name": "x", "list": [1, 2.5]},
    }


def assert_state_equal(a, b):
    assert a.keys() == b.keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["extra_state"] == b["extra_state"]


def test_atomic_save_then_load_weights_only(tmp_path):
    path = tmp_path / "sub" / "dir" / "checkpoint_last.pt"  # directories are created
    atomic_torch_save(small_state(), str(path))
    assert_state_equal(torch.load(path, weights_only=True), small_state())
    assert_state_equal(load_checkpoint_file(str(path)), small_state())
    assert os.listdir(path.parent) == ["checkpoint_last.pt"]  # no temporary left behind


def test_atomic_save_replaces_the_previous_file(tmp_path):
    path = str(tmp_path / "c.pt")
    atomic_torch_save(small_state(1.0), path)
    atomic_torch_save(small_state(7.0), path)
    assert_state_equal(load_checkpoint_file(path), small_state(7.0))
    assert os.listdir(tmp_path) == ["c.pt"]


def test_failed_save_keeps_the_previous_file_and_cleans_up(tmp_path):
    path = str(tmp_path / "c.pt")
    atomic_torch_save(small_state(1.0), path)
    before = open(path, "rb").read()
    with pytest.raises(Exception):
        atomic_torch_save({"model": {"w": torch.ones(2)}, "bad": lambda: 0}, path)  # cannot be pickled
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["c.pt"]


KILLED_WRITER = textwrap.dedent("""
    import sys
    import torch
    from fairseq.checkpoint.io import atomic_torch_save

    # 12 tensors of 25 MiB: 300 MiB to write
    obj = {"model": {f"w{i}": torch.full((25 * 2**20 // 4,), float(i + 100)) for i in range(12)}}
    atomic_torch_save(obj, sys.argv[1])
    print("finished", flush=True)
""")


def test_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    save_dir = tmp_path / "ck"
    path = save_dir / "checkpoint_last.pt"
    atomic_torch_save(small_state(3.0), str(path))
    before = path.read_bytes()

    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(path)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    tmp_file = None
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            for name in os.listdir(save_dir):
                if name != "checkpoint_last.pt":
                    try:
                        if os.path.getsize(save_dir / name) > 0:  # torch.save has started writing
                            tmp_file = name
                    except FileNotFoundError:
                        pass
            if tmp_file:
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        if proc.poll() is None and tmp_file is None:
            proc.kill()
        out, err = proc.communicate(timeout=60)
    assert tmp_file is not None, f"no temporary file seen; writer exited {proc.returncode}: {err.decode()[-2000:]}"
    assert proc.returncode == -signal.SIGKILL, "the writer finished before it could be killed"
    assert b"finished" not in out

    # the previous checkpoint is untouched and still loads
    assert path.read_bytes() == before
    assert_state_equal(load_checkpoint_file(str(path)), small_state(3.0))
    # the partial file is a hidden temporary, never taken for a checkpoint
    leftovers = sorted(set(os.listdir(save_dir)) - {"checkpoint_last.pt"})
    assert leftovers == [tmp_file]
    assert tmp_file.startswith(".checkpoint_last.pt.") and tmp_file.endswith(".tmp")
    assert os.path.getsize(save_dir / tmp_file) < 300 * 2**20
    assert existing_checkpoint(str(path)) == str(path)
    cfg = CheckpointConfig(keep_interval_updates=1, keep_last_epochs=1, keep_best_checkpoints=1)
    assert prune_checkpoints(cfg, str(save_dir)) == []
    # and the next save goes through normally and clears the killed save's leftover
    atomic_torch_save(small_state(4.0), str(path))
    assert_state_equal(load_checkpoint_file(str(path)), small_state(4.0))
    assert sorted(os.listdir(save_dir)) == ["checkpoint_last.pt"]


# ----------------------------------------------------------------------------- atomic_copy


def test_atomic_copy_is_identical_and_independent_of_later_source_replacement(tmp_path):
    src, dst = str(tmp_path / "checkpoint_1_10.pt"), str(tmp_path / "checkpoint_last.pt")
    atomic_torch_save(small_state(1.0), src)
    atomic_torch_save(small_state(9.0), dst)  # an older copy is replaced
    atomic_copy(src, dst)
    assert open(dst, "rb").read() == open(src, "rb").read()
    original = open(src, "rb").read()
    atomic_torch_save(small_state(2.0), src)  # the next save replaces the source
    assert open(dst, "rb").read() == original
    assert_state_equal(load_checkpoint_file(dst), small_state(1.0))
    assert_state_equal(load_checkpoint_file(src), small_state(2.0))
    os.remove(src)  # removing the source (pruning) leaves the copy
    assert_state_equal(load_checkpoint_file(dst), small_state(1.0))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_last.pt"]


# ----------------------------------------------------------------------------- load_checkpoint_file


def _legacy_file(path):
    args = argparse.Namespace(arch="transformer_lm", task="language_modeling", decoder_layers=2)
    torch.save({"args": args, "model": {"decoder.embed_tokens.weight": torch.ones(4, 2)}}, path)


def test_pickled_namespace_needs_trust_legacy_checkpoint(tmp_path):
    path = str(tmp_path / "upstream.pt")
    _legacy_file(path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_file(path)
    assert "--trust-legacy-checkpoint" in str(info.value)
    assert path in str(info.value)


def test_pickled_namespace_loads_when_trusted(tmp_path, caplog):
    path = str(tmp_path / "upstream.pt")
    _legacy_file(path)
    with caplog.at_level(logging.WARNING, logger="fairseq.checkpoint.io"):
        state = load_checkpoint_file(path, trust_legacy=True)
    assert isinstance(state["args"], argparse.Namespace)
    assert state["args"].arch == "transformer_lm" and state["args"].decoder_layers == 2
    assert torch.equal(state["model"]["decoder.embed_tokens.weight"], torch.ones(4, 2))
    assert "--trust-legacy-checkpoint" in caplog.text


def test_plain_file_loads_the_same_with_or_without_trust(tmp_path):
    path = str(tmp_path / "c.pt")
    atomic_torch_save(small_state(5.0), path)
    assert_state_equal(load_checkpoint_file(path, trust_legacy=True), small_state(5.0))


@pytest.mark.parametrize("trust", [False, True])
def test_truncated_file_is_a_checkpoint_error_naming_it(tmp_path, trust):
    path = str(tmp_path / "checkpoint_last.pt")
    atomic_torch_save(small_state(), path)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated") as info:
        load_checkpoint_file(path, trust_legacy=trust)
    assert path in str(info.value)


def test_empty_file_is_a_checkpoint_error(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    open(path, "wb").close()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_file(path)
    assert path in str(info.value)


def test_small_file_missing_its_last_byte_is_a_checkpoint_error(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    atomic_torch_save({"model": {"w": torch.zeros(1000)}, "x": 1}, path)
    data = open(path, "rb").read()
    assert 4096 < len(data) < 65536
    with open(path, "wb") as f:
        f.write(data[:-1])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_file(path)
    assert path in str(info.value)


def test_large_file_missing_its_last_byte_is_a_checkpoint_error(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    atomic_torch_save({"model": {"w": torch.zeros(30000)}, "x": 1}, path)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:-1])
    with pytest.raises(CheckpointError, match="truncated") as info:
        load_checkpoint_file(path)
    assert path in str(info.value)


def test_text_file_is_a_checkpoint_error(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    with open(path, "w") as f:
        f.write("hello world\n")
    with pytest.raises(CheckpointError):
        load_checkpoint_file(path)


def test_missing_file_is_file_not_found(tmp_path):
    path = str(tmp_path / "nope.pt")
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_checkpoint_file(path)
    with pytest.raises(FileNotFoundError):
        load_checkpoint_file(path, trust_legacy=True)
