"""scripts/average_checkpoints.py: upstream's averaging rule and flags, read without unpickling code."""

import argparse
import collections
import os

import pytest
import torch

from fairseq.utils import run_console_script
from scripts.average_checkpoints import average_checkpoints, best_n_checkpoints, last_n_checkpoints, main


def save(path, model, **extra):
    torch.save(dict(model=model, **extra), str(path))
    return str(path)


def test_mean_of_floats_and_floor_of_integers(tmp_path):
    a = save(
        tmp_path / "a.pt",
        collections.OrderedDict(
            [
                ("a", torch.tensor([100.0], dtype=torch.float64)),
                ("b", torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])),
                ("c", torch.tensor([7, 8, 9], dtype=torch.int32)),
                ("h", torch.tensor([1.0], dtype=torch.float16)),
            ]
        ),
        extra_state={"epoch": 1},
    )
    b = save(
        tmp_path / "b.pt",
        collections.OrderedDict(
            [
                ("a", torch.tensor([1.0], dtype=torch.float64)),
                ("b", torch.ones(2, 3)),
                ("c", torch.tensor([2, 2, 2], dtype=torch.int32)),
                ("h", torch.tensor([2.0], dtype=torch.float16)),
            ]
        ),
    )
    out = average_checkpoints([a, b])
    assert list(out["model"]) == ["a", "b", "c", "h"] and out["extra_state"] == {"epoch": 1}  # the first's rest
    assert out["model"]["a"].tolist() == [50.5] and out["model"]["b"].tolist() == [[1.0, 1.5, 2.0], [2.5, 3.0, 3.5]]
    assert out["model"]["c"].tolist() == [4, 5, 5] and out["model"]["c"].dtype == torch.int32  # truncated
    assert out["model"]["h"].dtype == torch.float32 and out["model"]["h"].tolist() == [1.5]


def test_tied_parameters_are_summed_apart(tmp_path):
    paths = []
    for value in (1.0, 2.0, 3.0):
        fc = torch.nn.Linear(4, 4)
        torch.nn.init.constant_(fc.weight, value)
        paths.append(save(tmp_path / f"m{value}.pt", {"fc1.weight": fc.weight.data, "fc2.weight": fc.weight.data}))
    out = average_checkpoints(paths)["model"]
    assert torch.equal(out["fc1.weight"], torch.full((4, 4), 2.0)) and torch.equal(out["fc2.weight"], out["fc1.weight"])


def test_the_same_keys_in_another_order_average(tmp_path):
    a = save(tmp_path / "a.pt", collections.OrderedDict([("x", torch.zeros(2)), ("y", torch.ones(1))]))
    b = save(tmp_path / "b.pt", collections.OrderedDict([("y", torch.full((1,), 3.0)), ("x", torch.full((2,), 4.0))]))
    out = average_checkpoints([a, b])["model"]
    assert list(out) == ["x", "y"] and out["x"].tolist() == [2.0, 2.0] and out["y"].tolist() == [2.0]


@pytest.mark.parametrize(
    "other,first_difference",
    [
        ({"x": torch.zeros(2), "z": torch.zeros(1), "w": torch.zeros(1)}, "w"),  # other keys: the first, sorted
        ({"x": torch.zeros(3), "y": torch.zeros(1)}, "x"),  # another shape
    ],
)
def test_other_parameters_are_one_line_naming_both_files_and_the_key(tmp_path, capsys, other, first_difference):
    a = save(tmp_path / "a.pt", {"x": torch.zeros(2), "y": torch.zeros(1)})
    b = save(tmp_path / "b.pt", other)
    with pytest.raises(SystemExit) as e:
        run_console_script("average_checkpoints", main, ["--inputs", a, b, "--output", str(tmp_path / "avg.pt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and err[0].startswith("average_checkpoints: error: "), err
    assert a in err[0] and b in err[0] and f"'{first_difference}'" in err[0]
    assert not (tmp_path / "avg.pt").exists()


def test_choosing_the_last_or_best_checkpoints(tmp_path):
    for name in (
        "checkpoint1.pt",
        "checkpoint2.pt",
        "checkpoint10.pt",
        "checkpoint_1_100.pt",
        "checkpoint_2_200.pt",
        "checkpoint_3_300.pt",
        "checkpoint_last.pt",
        "checkpoint_best.pt",
    ):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "checkpoint_4_400").mkdir()  # a sharded checkpoint directory counts too
    d = str(tmp_path)
    assert last_n_checkpoints([d], 2, update_based=False) == [
        os.path.join(d, "checkpoint10.pt"),
        os.path.join(d, "checkpoint2.pt"),
    ]
    assert last_n_checkpoints([d], 2, update_based=True, upper_bound=300) == [
        os.path.join(d, "checkpoint_3_300.pt"),
        os.path.join(d, "checkpoint_2_200.pt"),
    ]
    assert last_n_checkpoints([d], 1, update_based=True) == [os.path.join(d, "checkpoint_4_400")]
    with pytest.raises(ValueError, match="found 3 epoch checkpoints .* asks for 5"):
        last_n_checkpoints([d], 5, update_based=False)
    best = ["checkpoint.best_loss_3.5000.pt", "checkpoint.best_loss_2.2500.pt", "checkpoint.best_loss_2.9000.pt"]
    assert best_n_checkpoints(best, 2) == ["checkpoint.best_loss_2.2500.pt", "checkpoint.best_loss_2.9000.pt"]


def test_script_writes_the_average_and_refuses_pickled_files(tmp_path, capsys):
    save(tmp_path / "checkpoint_1_10.pt", {"w": torch.tensor([1.0])})
    save(tmp_path / "checkpoint_1_20.pt", {"w": torch.tensor([3.0])})
    output = str(tmp_path / "avg.pt")
    main(["--inputs", str(tmp_path), "--num-update-checkpoints", "2", "--output", output])
    assert torch.load(output, weights_only=True)["model"]["w"].tolist() == [2.0]
    legacy = save(tmp_path / "legacy.pt", {"w": torch.tensor([1.0])}, args=argparse.Namespace(arch="lm"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # the script's entry point, as `python scripts/average_checkpoints.py`
        run_console_script(
            "average_checkpoints", main, ["--inputs", legacy, legacy, "--output", str(tmp_path / "x.pt")]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and err[0].startswith("average_checkpoints: error: ")
    assert "pickled Python objects" in err[0] and "--trust-legacy-checkpoint" in err[0]
    main(["--inputs", legacy, legacy, "--output", str(tmp_path / "x.pt"), "--trust-legacy-checkpoint"])


# ----------------------------------------------------------------------------- real checkpoints of fairseq-train


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """checkpoint_last.pt of three tiny runs on tiny_data ("a", "seed": another seed, "gelu_prenorm": another
    activation and normalization order: the same parameter names and shapes) and one ("swapped") on a copy
    whose dict.txt has two lines swapped (the same size)."""
    from tests.train_fixtures import default_train_argv, train_in_process

    root = tmp_path_factory.mktemp("average")
    swapped = root / "swapped-data"
    swapped.mkdir()
    for name in os.listdir(tiny_data):
        if name != "dict.txt":
            os.symlink(os.path.join(tiny_data, name), swapped / name)
    lines = (tiny_data / "dict.txt").read_text().splitlines(keepends=True)
    lines[0], lines[1] = lines[1], lines[0]
    (swapped / "dict.txt").write_text("".join(lines))
    runs = {
        "a": (tiny_data, []),
        "seed": (tiny_data, ["--seed", "4"]),
        "swapped": (swapped, []),
        "gelu_prenorm": (
            tiny_data,
            ["--activation-fn", "gelu", "--decoder-normalize-before", "--no-decoder-final-norm"],
        ),
    }
    paths = {}
    for name, (data, extra) in runs.items():
        status, _, err = train_in_process(default_train_argv(data, root / name, *extra, max_update=1))
        assert status == 0, err
        paths[name] = str(root / name / "checkpoint_last.pt")
    return paths


def _average(capsys, *argv):
    """(exit status, stderr lines) of the script's entry point, as `python scripts/average_checkpoints.py`."""
    capsys.readouterr()
    try:
        run_console_script("average_checkpoints", main, list(argv))
        status = 0
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "other,differs",
    [
        ("swapped", "were trained with different dictionaries (dictionary_sha256 "),
        ("gelu_prenorm", "are different models: --decoder-normalize-before is True in {other} but False in {first}"),
    ],
)
def test_checkpoints_of_another_dictionary_or_architecture_are_one_line(trained, tmp_path, capsys, other, differs):
    """The same parameter names and shapes, but other words for the same ids, or another function computed."""
    output = tmp_path / "avg.pt"
    status, err = _average(capsys, "--inputs", trained["a"], trained[other], "--output", str(output))
    assert status == 1 and len(err) == 1 and err[0].startswith("average_checkpoints: error: "), err
    assert trained["a"] in err[0] and trained[other] in err[0]
    assert differs.format(other=trained[other], first=trained["a"]) in err[0], err[0]
    assert not output.exists()
    assert _average(capsys, "--inputs", trained["a"], trained["seed"], "--output", str(output))[0] == 0
    assert output.exists()  # checkpoints of one model (other seeds) still average


def test_output_that_is_an_input_is_refused(trained, tmp_path, capsys):
    before = open(trained["a"], "rb").read()
    os.symlink(trained["a"], tmp_path / "link.pt")
    for output in (trained["a"], os.path.relpath(trained["a"]), str(tmp_path / "link.pt")):
        status, err = _average(capsys, "--inputs", trained["a"], trained["seed"], "--output", output)
        assert status == 1 and err == [
            f"average_checkpoints: error: --output {output} is the input {trained['a']}: "
            "writing the average would replace that checkpoint; choose another --output"
        ]
    assert open(trained["a"], "rb").read() == before


def test_unwritable_output_names_the_output_flag(trained, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    output = str(blocker / "avg.pt")
    status, err = _average(capsys, "--inputs", trained["a"], trained["seed"], "--output", output)
    assert (
        status == 1
        and len(err) == 1
        and err[0].startswith(f"average_checkpoints: error: cannot write checkpoint {output}: ")
    ), err
    assert err[0].endswith("choose another --output"), err[0]
