"""fairseq.checkpoint.paths: upstream checkpoint names, retention of old ones, restore-path resolution."""

import os

import torch

from fairseq.checkpoint.paths import (
    checkpoint_stems,
    enters_kept_best,
    existing_checkpoint,
    newer_than_last,
    prune_checkpoints,
    resolve_restore_path,
)
from fairseq.dataclass.configs import CheckpointConfig


def ck(**kw):
    return CheckpointConfig(**kw)


# ----------------------------------------------------------------------------- names


def test_end_of_epoch_writes_epoch_and_last():
    assert checkpoint_stems(ck(), epoch=3, updates=300, end_of_epoch=True, is_best=False) == [
        "checkpoint3",
        "checkpoint_last",
    ]


def test_save_interval_skips_epochs():
    cfg = ck(save_interval=2)
    assert checkpoint_stems(cfg, 3, 300, True, False) == ["checkpoint_last"]
    assert checkpoint_stems(cfg, 4, 400, True, False) == ["checkpoint4", "checkpoint_last"]


def test_mid_epoch_with_save_interval_updates():
    cfg = ck(save_interval_updates=100)
    assert checkpoint_stems(cfg, 2, 300, end_of_epoch=False, is_best=False) == ["checkpoint_2_300", "checkpoint_last"]
    assert checkpoint_stems(cfg, 2, 350, end_of_epoch=False, is_best=False) == ["checkpoint_last"]
    # at an epoch end the epoch checkpoint is written, not an update one
    assert checkpoint_stems(cfg, 2, 400, end_of_epoch=True, is_best=False) == ["checkpoint2", "checkpoint_last"]
    # without --save-interval-updates, no update checkpoint mid-epoch
    assert checkpoint_stems(ck(), 2, 300, end_of_epoch=False, is_best=False) == ["checkpoint_last"]


def test_best_comes_before_last():
    assert checkpoint_stems(ck(), 1, 10, True, is_best=True, val_loss=2.5) == [
        "checkpoint1",
        "checkpoint_best",
        "checkpoint_last",
    ]
    assert checkpoint_stems(ck(save_interval_updates=5), 1, 10, False, True, 2.5) == [
        "checkpoint_1_10",
        "checkpoint_best",
        "checkpoint_last",
    ]


def test_keep_best_naming():
    cfg = ck(keep_best_checkpoints=2)
    assert checkpoint_stems(cfg, 1, 10, True, True, val_loss=3.14159265, among_kept_best=True) == [
        "checkpoint1",
        "checkpoint_best",
        "checkpoint.best_loss_3.1416",
        "checkpoint_last",
    ]
    cfg = ck(keep_best_checkpoints=2, best_checkpoint_metric="accuracy", maximize_best_checkpoint_metric=True)
    assert checkpoint_stems(cfg, 1, 10, True, True, val_loss=71.0, among_kept_best=True) == [
        "checkpoint1",
        "checkpoint_best",
        "checkpoint.best_accuracy_71.0000",
        "checkpoint_last",
    ]
    # among the kept best without being the overall best: a best file, no checkpoint_best
    assert checkpoint_stems(cfg, 1, 10, True, False, val_loss=70.0, among_kept_best=True) == [
        "checkpoint1",
        "checkpoint.best_accuracy_70.0000",
        "checkpoint_last",
    ]
    # not among them: no best file
    assert checkpoint_stems(cfg, 1, 10, True, False, val_loss=71.0) == ["checkpoint1", "checkpoint_last"]


def test_keep_best_keeps_the_n_best_values_not_the_n_latest_records(tmp_path):
    cfg = ck(keep_best_checkpoints=2)
    saved = []
    for val_loss in [5.0, 3.0, 4.0, 4.5, 2.0]:
        if enters_kept_best(cfg, str(tmp_path), val_loss):
            stem = checkpoint_stems(cfg, 1, 1, False, False, val_loss, among_kept_best=True)[0]
            make(tmp_path, [stem])
            saved.append(val_loss)
            prune_checkpoints(cfg, str(tmp_path))
    # 4.0 is not a record (3.0 came before) but ranks second; 4.5 no longer ranks among the two best
    assert saved == [5.0, 3.0, 4.0, 2.0]
    assert listing(tmp_path) == ["checkpoint.best_loss_2.0000.pt", "checkpoint.best_loss_3.0000.pt"]


def test_enters_kept_best_edges(tmp_path):
    make(tmp_path, ["checkpoint.best_acc_70.0000", "checkpoint.best_acc_80.0000", "checkpoint.best_loss_1.0000"])
    maximize = ck(keep_best_checkpoints=2, best_checkpoint_metric="acc", maximize_best_checkpoint_metric=True)
    assert enters_kept_best(maximize, str(tmp_path), 75.0)
    assert not enters_kept_best(maximize, str(tmp_path), 70.0)  # a tie with the worst kept does not enter
    assert not enters_kept_best(maximize, str(tmp_path), 60.0)
    assert enters_kept_best(
        ck(keep_best_checkpoints=3, best_checkpoint_metric="acc", maximize_best_checkpoint_metric=True),
        str(tmp_path),
        1.0,
    )  # room left
    assert not enters_kept_best(maximize, str(tmp_path), None)
    assert not enters_kept_best(ck(), str(tmp_path), 0.1)  # --keep-best-checkpoints off
    assert enters_kept_best(ck(keep_best_checkpoints=1), str(tmp_path / "missing"), 9.0)
    loss = ck(keep_best_checkpoints=3)
    assert not enters_kept_best(loss, str(tmp_path), float("nan"))  # its name would never be pruned
    assert not enters_kept_best(loss, str(tmp_path), float("inf"))
    # equal to a kept result once named with 4 decimals: would overwrite that file, so it does not enter
    assert not enters_kept_best(loss, str(tmp_path), 1.00004)
    assert enters_kept_best(loss, str(tmp_path), 1.00006)  # named 1.0001: a new file


def test_no_epoch_and_no_last_checkpoints():
    assert checkpoint_stems(ck(no_epoch_checkpoints=True), 3, 300, True, False) == ["checkpoint_last"]
    assert checkpoint_stems(ck(no_epoch_checkpoints=True), 3, 300, True, True, 1.0) == [
        "checkpoint_best",
        "checkpoint_last",
    ]
    assert checkpoint_stems(ck(no_last_checkpoints=True), 3, 300, True, False) == ["checkpoint3"]
    assert checkpoint_stems(ck(no_last_checkpoints=True, no_epoch_checkpoints=True), 3, 300, True, False) == []


def test_checkpoint_suffix_everywhere():
    cfg = ck(checkpoint_suffix="-x", save_interval_updates=10, keep_best_checkpoints=1)
    assert checkpoint_stems(cfg, 2, 20, False, True, 1.5, among_kept_best=True) == [
        "checkpoint_2_20-x",
        "checkpoint_best-x",
        "checkpoint.best_loss_1.5000-x",
        "checkpoint_last-x",
    ]
    assert checkpoint_stems(cfg, 2, 20, True, False) == ["checkpoint2-x", "checkpoint_last-x"]


# ----------------------------------------------------------------------------- retention


def make(save_dir, names, sharded=()):
    """`.pt` files for `names`, directories (sharded checkpoints with metadata.pt) for `sharded`."""
    os.makedirs(save_dir, exist_ok=True)
    for n in names:
        with open(os.path.join(save_dir, n + ".pt"), "wb") as f:
            f.write(n.encode())
    for n in sharded:
        os.makedirs(os.path.join(save_dir, n))
        with open(os.path.join(save_dir, n, "metadata.pt"), "wb") as f:
            f.write(b"m")


def listing(save_dir):
    return sorted(os.listdir(save_dir))


def test_keep_interval_updates_is_numeric_not_lexical(tmp_path):
    make(
        tmp_path,
        [
            "checkpoint_1_999",
            "checkpoint_1_1000",
            "checkpoint_2_1001",
            "checkpoint_1_98",
            "checkpoint_last",
            "checkpoint1",
        ],
    )
    removed = prune_checkpoints(ck(keep_interval_updates=2), str(tmp_path))
    assert sorted(removed) == sorted(str(tmp_path / n) for n in ["checkpoint_1_999.pt", "checkpoint_1_98.pt"])
    assert listing(tmp_path) == ["checkpoint1.pt", "checkpoint_1_1000.pt", "checkpoint_2_1001.pt", "checkpoint_last.pt"]


def test_keep_interval_updates_sorts_by_updates_not_epoch(tmp_path):
    make(tmp_path, ["checkpoint_3_300", "checkpoint_10_200", "checkpoint_2_400"])
    prune_checkpoints(ck(keep_interval_updates=1), str(tmp_path))
    assert listing(tmp_path) == ["checkpoint_2_400.pt"]


def test_keep_interval_updates_counts_files_and_sharded_directories_together(tmp_path):
    make(tmp_path, ["checkpoint_1_100", "checkpoint_1_300"], sharded=["checkpoint_1_200", "checkpoint_1_400"])
    removed = prune_checkpoints(ck(keep_interval_updates=2), str(tmp_path))
    assert sorted(removed) == [str(tmp_path / "checkpoint_1_100.pt"), str(tmp_path / "checkpoint_1_200")]
    assert listing(tmp_path) == ["checkpoint_1_300.pt", "checkpoint_1_400"]
    assert os.path.isfile(tmp_path / "checkpoint_1_400" / "metadata.pt")


def test_pruning_ignores_temporaries_old_copies_and_other_suffixes(tmp_path):
    make(
        tmp_path,
        ["checkpoint_1_100", "checkpoint_1_200-x", "checkpoint_1_300"],
        sharded=["checkpoint_1_50.tmp", "checkpoint_1_60.old"],
    )
    (tmp_path / ".checkpoint_1_10.pt.abc.tmp").write_bytes(b"partial")
    prune_checkpoints(ck(keep_interval_updates=1), str(tmp_path))
    assert listing(tmp_path) == [
        ".checkpoint_1_10.pt.abc.tmp",
        "checkpoint_1_200-x.pt",
        "checkpoint_1_300.pt",
        "checkpoint_1_50.tmp",
        "checkpoint_1_60.old",
    ]


def test_keep_interval_updates_with_suffix_touches_only_that_suffix(tmp_path):
    make(tmp_path, ["checkpoint_1_100-x", "checkpoint_1_200-x", "checkpoint_1_300-x", "checkpoint_1_50"])
    prune_checkpoints(ck(keep_interval_updates=1, checkpoint_suffix="-x"), str(tmp_path))
    assert listing(tmp_path) == ["checkpoint_1_300-x.pt", "checkpoint_1_50.pt"]


def _interval_dir(tmp_path):
    make(tmp_path, [f"checkpoint_1_{u}" for u in range(100, 1001, 100)])
    return str(tmp_path)


def test_keep_interval_updates_pattern_spares_multiples(tmp_path):
    prune_checkpoints(ck(keep_interval_updates=2, keep_interval_updates_pattern=500), _interval_dir(tmp_path))
    kept = listing(tmp_path)
    for u in (1000, 900, 500):
        assert f"checkpoint_1_{u}.pt" in kept
    for u in (700, 600, 400, 300, 200, 100):
        assert f"checkpoint_1_{u}.pt" not in kept


def test_keep_interval_updates_pattern_as_upstream(tmp_path):
    prune_checkpoints(ck(keep_interval_updates=2, keep_interval_updates_pattern=500), _interval_dir(tmp_path))
    assert listing(tmp_path) == [f"checkpoint_1_{u}.pt" for u in (1000, 500, 800, 900)]


def test_keep_last_epochs(tmp_path):
    make(
        tmp_path,
        ["checkpoint9", "checkpoint10", "checkpoint11", "checkpoint_10_5", "checkpoint_last", "checkpoint_best"],
        sharded=["checkpoint8"],
    )
    removed = prune_checkpoints(ck(keep_last_epochs=2), str(tmp_path))
    assert sorted(removed) == [str(tmp_path / "checkpoint8"), str(tmp_path / "checkpoint9.pt")]
    assert listing(tmp_path) == [
        "checkpoint10.pt",
        "checkpoint11.pt",
        "checkpoint_10_5.pt",
        "checkpoint_best.pt",
        "checkpoint_last.pt",
    ]


def test_keep_best_checkpoints_minimize(tmp_path):
    make(
        tmp_path,
        [
            "checkpoint.best_loss_3.5000",
            "checkpoint.best_loss_10.0000",
            "checkpoint.best_loss_2.2500",
            "checkpoint_best",
        ],
        sharded=["checkpoint.best_loss_3.0000"],
    )
    prune_checkpoints(ck(keep_best_checkpoints=2), str(tmp_path))
    assert listing(tmp_path) == ["checkpoint.best_loss_2.2500.pt", "checkpoint.best_loss_3.0000", "checkpoint_best.pt"]


def test_keep_best_checkpoints_maximize(tmp_path):
    make(
        tmp_path,
        [
            "checkpoint.best_acc_9.5000",
            "checkpoint.best_acc_10.0000",
            "checkpoint.best_acc_70.2500",
            "checkpoint.best_loss_1.0000",
        ],
    )
    prune_checkpoints(
        ck(keep_best_checkpoints=2, best_checkpoint_metric="acc", maximize_best_checkpoint_metric=True), str(tmp_path)
    )
    # numeric order (10 > 9.5), and files of another metric are left alone
    assert listing(tmp_path) == [
        "checkpoint.best_acc_10.0000.pt",
        "checkpoint.best_acc_70.2500.pt",
        "checkpoint.best_loss_1.0000.pt",
    ]


def test_nothing_is_pruned_by_default(tmp_path):
    names = [f"checkpoint_1_{u}" for u in range(1, 6)] + ["checkpoint1", "checkpoint2", "checkpoint.best_loss_1.0000"]
    make(tmp_path, names)
    assert prune_checkpoints(ck(), str(tmp_path)) == []
    assert len(listing(tmp_path)) == len(names)


def test_prune_on_missing_dir(tmp_path):
    assert prune_checkpoints(ck(keep_interval_updates=1, keep_last_epochs=1), str(tmp_path / "nope")) == []


# ----------------------------------------------------------------------------- restore path


def test_resolve_restore_path_default_uses_save_dir_and_suffix(tmp_path):
    assert resolve_restore_path(ck(save_dir=str(tmp_path))) == str(tmp_path / "checkpoint_last.pt")
    assert resolve_restore_path(ck(save_dir=str(tmp_path), checkpoint_suffix="-s")) == str(
        tmp_path / "checkpoint_last-s.pt"
    )


def test_resolve_restore_path_bare_name_is_in_save_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save = tmp_path / "ck"
    assert resolve_restore_path(ck(save_dir=str(save), restore_file="checkpoint_2_100.pt")) == str(
        save / "checkpoint_2_100.pt"
    )
    # a bare name that exists in the working directory is that file
    (tmp_path / "here.pt").write_bytes(b"x")
    assert resolve_restore_path(ck(save_dir=str(save), restore_file="here.pt")) == "here.pt"


def test_resolve_restore_path_keeps_paths(tmp_path):
    other = str(tmp_path / "elsewhere" / "model.pt")
    assert resolve_restore_path(ck(save_dir=str(tmp_path / "ck"), restore_file=other)) == other
    assert resolve_restore_path(ck(save_dir="ck", restore_file="sub/model.pt")) == "sub/model.pt"


def test_existing_checkpoint_prefers_the_file(tmp_path):
    make(tmp_path, ["checkpoint_last"], sharded=["checkpoint_last"])
    assert existing_checkpoint(str(tmp_path / "checkpoint_last.pt")) == str(tmp_path / "checkpoint_last.pt")


def test_existing_checkpoint_sharded_directory(tmp_path):
    make(tmp_path, [], sharded=["checkpoint_last"])
    assert existing_checkpoint(str(tmp_path / "checkpoint_last.pt")) == str(tmp_path / "checkpoint_last")
    assert existing_checkpoint(str(tmp_path / "checkpoint_last")) == str(tmp_path / "checkpoint_last")


def test_existing_checkpoint_incomplete_directory_is_not_a_checkpoint(tmp_path):
    os.makedirs(tmp_path / "checkpoint_last")  # a save that never wrote metadata.pt
    (tmp_path / "checkpoint_last" / "__0_0.distcp").write_bytes(b"x")
    assert existing_checkpoint(str(tmp_path / "checkpoint_last.pt")) is None
    assert existing_checkpoint(str(tmp_path / "missing.pt")) is None


def test_existing_checkpoint_falls_back_to_old_copy(tmp_path):
    make(tmp_path, [], sharded=["checkpoint_last.old"])  # died between moving aside and renaming into place
    assert existing_checkpoint(str(tmp_path / "checkpoint_last.pt")) == str(tmp_path / "checkpoint_last.old")
    # a complete directory wins over the old copy
    make(tmp_path, [], sharded=["checkpoint_last"])
    assert existing_checkpoint(str(tmp_path / "checkpoint_last.pt")) == str(tmp_path / "checkpoint_last")


def test_existing_checkpoint_real_file_content(tmp_path):
    path = tmp_path / "checkpoint3.pt"
    torch.save({"model": {"w": torch.ones(2)}}, path)
    found = existing_checkpoint(str(path))
    assert torch.equal(torch.load(found, weights_only=True)["model"]["w"], torch.ones(2))


# ----------------------------------------------------------------------------- what a resume continues from


def sharded_checkpoint(path, updates):
    """A sharded checkpoint directory as far as choosing one reads it: DCP's index and metadata.pt's progress."""
    os.makedirs(path)
    open(os.path.join(path, ".metadata"), "wb").close()
    torch.save(
        {"extra_state": {"trainer": {"num_updates": updates}, "train_iterator": {"epoch": 1}}},
        os.path.join(path, "metadata.pt"),
    )


def test_a_sharded_checkpoint_newer_than_checkpoint_last_is_chosen_by_stored_progress(tmp_path):
    d = str(tmp_path)
    sharded_checkpoint(os.path.join(d, "checkpoint_last"), 8)
    sharded_checkpoint(os.path.join(d, "checkpoint_1_10"), 10)
    sharded_checkpoint(os.path.join(d, "checkpoint_1_99"), 4)  # the name says 99, what it stores 4
    sharded_checkpoint(os.path.join(d, "checkpoint_1_12-other"), 12)  # another --checkpoint-suffix's
    os.makedirs(os.path.join(d, "checkpoint_1_14.tmp"))  # a killed save's temporary
    last = os.path.join(d, "checkpoint_last")
    assert newer_than_last(d, "", last) == (
        os.path.join(d, "checkpoint_1_10"),
        "checkpoint_last is at update 8 but checkpoint_1_10 (update 10) is newer and intact",
    )
    assert newer_than_last(d, "-other", None) == (
        os.path.join(d, "checkpoint_1_12-other"),
        "there is no checkpoint_last-other but checkpoint_1_12-other (update 12) is intact",
    )
    sharded_checkpoint(os.path.join(d, "checkpoint_best"), 8)
    os.remove(os.path.join(d, "checkpoint_1_10", ".metadata"))  # incomplete: not a candidate
    assert newer_than_last(d, "", last) is None  # nothing intact beyond update 8


def test_a_damaged_checkpoint_last_is_left_to_the_error_that_names_the_intact_ones(tmp_path):
    sharded_checkpoint(str(tmp_path / "checkpoint_1_10"), 10)
    (tmp_path / "checkpoint_last.pt").write_bytes(b"garbage, not a checkpoint")
    assert newer_than_last(str(tmp_path), "", str(tmp_path / "checkpoint_last.pt")) is None
