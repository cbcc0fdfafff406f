"""Behaviours where upstream fairseq users would notice a difference: over-long items, the output
dictionary size, and evaluating --add-bos-token models."""

import pytest
import torch

from fairseq_cli import eval_lm, preprocess, train
from test_train_cli import _eval_cfg, load


@pytest.fixture(scope="module")
def data_with_a_long_line(tmp_path_factory):
    root = tmp_path_factory.mktemp("longline")
    lines = [" ".join(f"w{(i * 7 + j) % 30}" for j in range(3 + i % 8)) for i in range(300)]
    lines.insert(150, " ".join(["w1"] * 40))  # one sentence longer than any block
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    preprocess.cli_main(
        [
            "--only-source",
            "--trainpref",
            str(root / "train.txt"),
            "--validpref",
            str(root / "train.txt"),
            "--destdir",
            str(root / "bin"),
        ]
    )
    return root / "bin"


def test_items_longer_than_the_model_accepts_are_skipped_in_training(data_with_a_long_line, tmp_path, caplog):
    argv = [
        "--task",
        "language_modeling",
        str(data_with_a_long_line),
        "--save-dir",
        str(tmp_path),
        "--arch",
        "transformer_lm_gpt3_small",
        "--decoder-layers",
        "1",
        "--decoder-embed-dim",
        "32",
        "--decoder-attention-heads",
        "2",
        "--optimizer",
        "adam",
        "--lr",
        "1e-3",
        "--tokens-per-sample",
        "16",
        "--sample-break-mode",
        "eos",
        "--batch-size",
        "4",
        "--cpu",
        "--num-workers",
        "0",
        "--max-update",
        "3",
    ]
    with pytest.raises(ValueError, match="--skip-invalid-size-inputs-valid-test"):
        train.cli_main(argv)  # validation refuses it unless told to skip, as upstream
    train.cli_main(argv + ["--skip-invalid-size-inputs-valid-test"])
    assert "1 items longer than --tokens-per-sample / --max-target-positions 16 are skipped" in caplog.text
    assert load(tmp_path / "checkpoint_last.pt")["extra_state"]["trainer"]["num_updates"] == 3


def test_output_dictionary_size_narrows_an_untied_output_projection(tiny_data, tmp_path, train_args):
    argv = train_args(tiny_data, tmp_path, "--output-dictionary-size", "20", max_update=2)
    argv.remove("--share-decoder-input-output-embed")
    train.cli_main(argv)
    state = load(tmp_path / "checkpoint_last.pt")
    assert state["model"]["decoder.output_projection.weight"].shape == (20, 32)
    assert state["model"]["decoder.embed_tokens.weight"].shape[0] > 20


def test_eval_lm_does_not_score_the_prepended_bos(tiny_data, tmp_path, train_args):
    train.cli_main(train_args(tiny_data, tmp_path / "plain", max_update=2))
    train.cli_main(train_args(tiny_data, tmp_path / "bos", "--add-bos-token", max_update=2))
    plain = eval_lm.main(_eval_cfg(tiny_data, tmp_path / "plain" / "checkpoint_last.pt"))
    # The checkpoint says it was trained with <s> first: eval-lm adds it without being told, and does not
    # count the prediction of <s> itself.
    with_bos = eval_lm.main(_eval_cfg(tiny_data, tmp_path / "bos" / "checkpoint_last.pt"))
    assert with_bos["tokens"] == plain["tokens"]
    state = torch.load(tmp_path / "bos" / "checkpoint_last.pt", weights_only=True)
    assert state["cfg"]["task"]["add_bos_token"] is True
