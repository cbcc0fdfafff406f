"""Where the data directory went wrong, the real entry points name the fix that applies: a checkpoint's saved
(relative) data directory without dict.txt when DATA is left out asks for DATA, not for fairseq-preprocess; a
missing split of fairseq-generate / fairseq-eval-lm names --gen-subset (the option they read) and the splits
DATA has."""

import os

import pytest
import torch

from fairseq_cli import eval_lm, generate, interactive
from tests.train_fixtures import console_in_process

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def relative_data_checkpoint(tiny_lm_checkpoint, tmp_path):
    """The tiny checkpoint as if trained with DATA `data-bin/lm` given relative to another directory."""
    state = torch.load(tiny_lm_checkpoint, map_location="cpu", weights_only=False)
    state["cfg"]["task"]["data"] = os.path.join("data-bin", "lm")
    path = tmp_path / "moved.pt"
    torch.save(state, path)
    return path


def test_interactive_without_data_asks_for_data(relative_data_checkpoint, tmp_path, monkeypatch, tiny_data):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr("sys.stdin", open(os.devnull))
    status, _, err = console_in_process(
        "fairseq-interactive", interactive.cli_main, ["--path", str(relative_data_checkpoint), "--cpu"]
    )
    saved = os.path.join("data-bin", "lm")
    assert status == 1 and err.strip() == (
        f"fairseq-interactive: error: no dict.txt in {saved} ({elsewhere / saved}), the data directory saved in "
        f"{relative_data_checkpoint} when it was trained: pass the data directory that holds the model's dict.txt "
        "as DATA (the first argument, before --path)"
    )
    # the fix it names works
    status, _, err = console_in_process(
        "fairseq-interactive", interactive.cli_main, [str(tiny_data), "--path", str(relative_data_checkpoint), "--cpu"]
    )
    assert status == 0, err
    # a DATA given on the command line without dict.txt is still a directory to preprocess
    status, _, err = console_in_process(
        "fairseq-interactive", interactive.cli_main, [str(elsewhere), "--path", str(relative_data_checkpoint), "--cpu"]
    )
    assert status == 1 and "run fairseq-preprocess first" in err


@pytest.mark.parametrize("name, main", [("fairseq-generate", generate.cli_main), ("fairseq-eval-lm", eval_lm.cli_main)])
def test_a_missing_gen_subset_names_gen_subset(tiny_data, tiny_lm_checkpoint, name, main):
    status, _, err = console_in_process(
        name,
        main,
        [str(tiny_data), "--path", str(tiny_lm_checkpoint), "--cpu", "--gen-subset", "tset", "--num-workers", "0"],
    )
    assert status == 1 and err.strip() == (
        f"{name}: error: Dataset not found: tset ({tiny_data / 'tset'}.bin/.idx) ({tiny_data} has test, train, "
        "valid); check DATA and --gen-subset or run fairseq-preprocess for this split"
    )
