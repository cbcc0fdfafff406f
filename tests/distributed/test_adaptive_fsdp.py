"""Adaptive input + tied adaptive softmax with --criterion adaptive_loss and --optimizer nag under
--ddp-backend fully_sharded (FSDP2) on 2 CPU processes (gloo), with sharded checkpoints and a resume, against
one process taking the same global batch as two micro-batches. Dropout is 0, so only summation order differs."""

import pytest
import torch

from fairseq.checkpoint.inference import load_model
from fairseq.logging.progress_bar import read_json_log
from fairseq_cli import train
from tests.train_fixtures import train_in_process

pytestmark = pytest.mark.timeout(900)

ADAPTIVE = [
    "--arch",
    "transformer_lm_wiki103",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "32",
    "--decoder-ffn-embed-dim",
    "64",
    "--decoder-attention-heads",
    "2",
    "--decoder-input-dim",
    "32",
    "--decoder-output-dim",
    "32",
    "--adaptive-input-cutoff",
    "20,40",
    "--adaptive-softmax-cutoff",
    "20,40",
    "--dropout",
    "0",
    "--attention-dropout",
    "0",
    "--activation-dropout",
    "0",
    "--adaptive-softmax-dropout",
    "0",
    "--criterion",
    "adaptive_loss",
    "--optimizer",
    "nag",
    "--lr",
    "0.05",
    "--lr-scheduler",
    "reduce_lr_on_plateau",
    "--tokens-per-sample",
    "32",
    "--batch-size",
    "4",
    "--required-batch-size-multiple",
    "1",
    "--sample-break-mode",
    "none",
    "--disable-validation",
    "--seed",
    "5",
    "--cpu",
    "--num-workers",
    "0",
    "--log-format",
    "json",
    "--log-interval",
    "1",
    "--heartbeat-timeout",
    "120",
]


def train_argv(data, save_dir, *extra, max_update):
    return [
        "--task",
        "language_modeling",
        str(data),
        "--save-dir",
        str(save_dir),
        *ADAPTIVE,
        "--max-update",
        str(max_update),
        "--log-file",
        str(save_dir / "train.log"),
        *extra,
    ]


def run_train(data, save_dir, *extra, max_update):
    """fairseq-train's entry point in this process; the ranks of --distributed-world-size are spawned from it."""
    status, out, err = train_in_process(train_argv(data, save_dir, *extra, max_update=max_update))
    assert status == 0, f"fairseq-train failed:\n{out[-3000:]}\n{err[-3000:]}"


def losses(save_dir):
    return {int(r["num_updates"]): float(r["loss"]) for r in read_json_log(save_dir / "train.log")}


def test_fully_sharded_adaptive_training_resumes_and_matches_one_process(tiny_data, tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir()
    sharded.mkdir()
    train.cli_main(train_argv(tiny_data, single, "--update-freq", "2", max_update=4))  # in this process
    fsdp = ["--ddp-backend", "fully_sharded", "--distributed-world-size", "2", "--use-sharded-state"]
    run_train(tiny_data, sharded, *fsdp, max_update=2)
    assert (sharded / "checkpoint_last").is_dir()
    run_train(tiny_data, sharded, *fsdp, max_update=4)  # resumes model, NAG state and scheduler from the shards

    ref, got = losses(single), losses(sharded)
    assert ref.keys() == got.keys() == {1, 2, 3, 4}
    for k in ref:
        assert abs(ref[k] - got[k]) <= 0.0015, (k, ref[k], got[k])  # logged with 3 decimals

    loaded = load_model(str(sharded / "checkpoint_last"), overrides={"data": str(tiny_data)})
    dec = loaded.model.decoder
    assert dec.adaptive_softmax.tail[1][2].weight is dec.embed_tokens.embeddings[2][0].weight  # tied again
    reference = torch.load(single / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    state = loaded.model.state_dict()
    assert state.keys() == reference.keys()
    for key in reference:  # the tied tensors were saved under both names, as upstream's are
        torch.testing.assert_close(state[key], reference[key], atol=2e-5, rtol=0, msg=key)
