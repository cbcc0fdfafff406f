"""Resume continues from the most trained intact checkpoint, by the progress it stores (fairseq.checkpoint.paths.
newer_than_last): a save killed after writing checkpoint_1_10.pt but before its copy to checkpoint_last.pt was
renamed leaves checkpoint_last.pt at update 8 (or, at a run's first save, no checkpoint_last.pt at all); the next
launch resumes checkpoint_1_10.pt, says so in one line, and never writes checkpoint_1_10.pt again (before, it
resumed update 8 and overwrote checkpoint_1_10.pt with the state it reached there)."""

import pytest
import torch

from tests.train_fixtures import default_train_argv, train_in_process

pytestmark = pytest.mark.usefixtures("one_thread")


def num_updates(path):
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["extra_state"]["trainer"]["num_updates"]


def run(data, save_dir, max_update):
    status, out, err = train_in_process(
        default_train_argv(data, save_dir, "--save-interval-updates", "2", max_update=max_update)
    )
    assert status == 0, out[-3000:] + err[-3000:]
    return out


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """A run to update 8, then resumed to 10: checkpoint_last.pt's bytes at 8 and at 10, checkpoint_1_10.pt's."""
    save_dir = tmp_path_factory.mktemp("trained")
    run(tiny_data, save_dir, 8)
    last_at_8 = (save_dir / "checkpoint_last.pt").read_bytes()
    run(tiny_data, save_dir, 10)
    return save_dir, last_at_8


@pytest.mark.parametrize("left", ["older", "missing"])
def test_a_kill_before_checkpoint_last_was_renamed_resumes_the_newest_intact_checkpoint(
    tiny_data, tmp_path, trained, left
):
    source, last_at_8 = trained
    for path in source.iterdir():
        if path.name.startswith("checkpoint"):
            (tmp_path / path.name).write_bytes(path.read_bytes())
    last, newest = tmp_path / "checkpoint_last.pt", tmp_path / "checkpoint_1_10.pt"
    ten = newest.read_bytes()
    assert num_updates(newest) == 10 and num_updates(last) == 10
    # What the kill during the copy leaves: checkpoint_last.pt as it was before the save, the copy's temporary.
    if left == "older":
        last.write_bytes(last_at_8)
        assert num_updates(last) == 8
    else:
        last.unlink()
    (tmp_path / ".checkpoint_last.pt.k1ll3d.tmp").write_bytes(ten[: len(ten) // 2])
    out = run(tiny_data, tmp_path, 12)
    why = (
        "checkpoint_last.pt is at update 8 but checkpoint_1_10.pt (update 10) is newer and intact"
        if left == "older"
        else "there is no checkpoint_last but checkpoint_1_10.pt (update 10) is intact"
    )
    assert out.count(f"{why}: resuming from it") == 1, out[-3000:]
    assert f"loaded checkpoint {newest} (10 updates)" in out
    assert newest.read_bytes() == ten  # training went on from 10: the checkpoint of update 10 is never rewritten
    assert num_updates(last) == 12 and num_updates(tmp_path / "checkpoint_1_12.pt") == 12
    assert not list(tmp_path.glob(".checkpoint_last.pt.*.tmp"))


def test_checkpoint_last_at_the_newest_update_is_resumed_without_a_word(tiny_data, tmp_path, trained):
    source, _ = trained
    for path in source.iterdir():
        if path.name.startswith("checkpoint"):
            (tmp_path / path.name).write_bytes(path.read_bytes())
    out = run(tiny_data, tmp_path, 12)
    assert "resuming from it" not in out
    assert f"loaded checkpoint {tmp_path / 'checkpoint_last.pt'} (10 updates)" in out
