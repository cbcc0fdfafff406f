"""Tensor parallelism and hybrid sharding on the device mesh, on CPU processes (gloo, fp32, dropout 0).

One spawn of 4 ranks runs every 4-rank scenario in sequence (starting processes costs more than the
scenarios); each rank saves what it measured and the tests compare:

- TP 2 x FSDP 2 (--update-freq 2), HSDP 2 x 2 and FSDP 4 train 5 updates of the same global batch (4
  batches of 4 x 32 tokens per update) as one process with --update-freq 4: the same losses (relative
  1e-5) and the same parameters after them; TP 2 x FSDP 2 with --fsdp-forward-prefetch --fsdp-sync-free is
  bitwise equal to TP 2 x FSDP 2 without them. These runs use the real task, model, criterion
  (vocab_parallel_cross_entropy) and Trainer through fairseq-train's own helpers, and read each update's
  exact loss sum from the trainer (the log rounds to 3 decimals).
- fairseq-train's main (in process) with --use-sharded-state: TP 2 x DP 2 runs to 6 updates, saving at 2
  and 4; from its update-2 checkpoint the same layout resumes to 4 bitwise equal, and DP 4 resumes to 4
  within tolerance. Two torchrun agents (--nnodes 2, 2 processes) then continue DP 4's checkpoint on
  TP 2 x DP 1 with --criterion cross_entropy (logits gathered instead of split) to 6, within tolerance of
  the uninterrupted run; the result is consolidated and scored by fairseq-eval-lm.
- upstream's megatron_11b training and evaluation command lines, scaled down, on 2 processes.

Tolerances. Every layout computes the one-process sums in another order (tensor-parallel partial sums
reduced across ranks, gradients averaged over data-parallel ranks): a few fp32 ulps (1.2e-7) per
operation, times the depth of the sums, well inside rtol 1e-5 for the losses. Parameters are compared at
atol 2e-5 after Adam (lr 3e-3): Adam's update is lr * m / sqrt(v), which turns a relative gradient error e
into a parameter error of about lr * e per step, except where the gradient itself is rounding noise (the
key-projection bias, whose true gradient is zero: softmax ignores a shift shared by all scores), which is
left out, as tests/distributed/test_train_distributed.py does.
"""

import math
import os

import pytest
import torch
import torch.distributed as dist

from tests.train_fixtures import spawn_scenarios, train_in_process
from fairseq.runtime.env import get_free_port

pytestmark = pytest.mark.timeout(600)

WORLD = 4
UPDATES = 5
LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-5
NOISE_ONLY = (".self_attn.k_proj.bias",)

# The model: 2 layers of 32, 4 heads, ffn 64 (tests/conftest.py's tiny transformer_lm_gpt), no dropout.
MODEL = [
    "--arch",
    "transformer_lm_gpt",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "32",
    "--decoder-ffn-embed-dim",
    "64",
    "--decoder-attention-heads",
    "4",
    "--dropout",
    "0",
    "--attention-dropout",
    "0",
]
TRAINING = [
    "--task",
    "language_modeling",
    "--optimizer",
    "adam",
    "--lr",
    "0.003",
    "--tokens-per-sample",
    "32",
    "--batch-size",
    "4",
    "--num-workers",
    "0",
    "--cpu",
    "--seed",
    "5",
    "--clip-norm",
    "0.5",
    "--required-batch-size-multiple",
    "1",
    "--disable-validation",
    "--criterion",
    "vocab_parallel_cross_entropy",
    "--heartbeat-timeout",
    "120",
]
TP2_FSDP2 = ["--ddp-backend", "fully_sharded", "--model-parallel-size", "2", "--update-freq", "2"]
HSDP2x2 = ["--ddp-backend", "fully_sharded", "--fsdp-shard-group-size", "2"]
FSDP4 = ["--ddp-backend", "fully_sharded"]
ONE_PROCESS = ["--update-freq", "4"]


def config(data, *flags):
    from fairseq import options
    from fairseq.frontend.validate import validate

    parser = options.get_training_parser()
    cfg = options.convert_namespace_to_config(
        options.parse_args_and_arch(parser, [str(data), *TRAINING, *MODEL, *flags])
    )
    validate(cfg)
    return cfg


def start_training(data, *flags):
    """(the real Trainer, a function that runs one update and returns its per-token loss), through
    fairseq-train's task, model and iterator helpers."""
    from fairseq import registry
    from fairseq.criterions import build_criterion
    from fairseq.data.iterators import GroupedIterator
    from fairseq.training.trainer import Trainer
    from fairseq.distributed.parallelize import build_model
    from fairseq.training.batch_iterators import trainer_iterator

    cfg = config(data, *flags)
    torch.manual_seed(cfg.common.seed)
    task = registry.TASK_REGISTRY.get(cfg.task._name).setup_task(cfg.task)
    model = build_model(cfg, task)
    trainer = Trainer(cfg, task, model, build_criterion(cfg.criterion, task, cfg.optimization))
    epoch_itr = trainer_iterator(cfg, task, trainer, 1)
    batches = GroupedIterator(epoch_itr.next_epoch_itr(shuffle=True), cfg.optimization.update_freq[0])

    def update():
        trainer.train_step(next(batches), epoch_itr)
        sums = trainer.read_train_stats()
        return sums["loss"] / sums["sample_size"]

    return trainer, update


def train_updates(data, *flags, updates=UPDATES):
    """(per-token loss of each update, full model state on rank 0) of `updates` updates (start_training)."""
    trainer, update = start_training(data, *flags)
    losses = [update() for _ in range(updates)]
    state, _ = trainer.model_and_optimizer_state(full=True)
    return losses, {k: v.detach().clone() for k, v in state.items()}


def run_main(data, save_dir, *flags):
    """fairseq-train's main, in this process, as cli_main would call it on this rank."""
    from fairseq_cli import train

    cfg = config(data, "--save-dir", str(save_dir), *flags)
    train.main(cfg)


CHECKPOINTS = ["--use-sharded-state", "--no-epoch-checkpoints"]


def scenarios(rank, data, out):  # the same scenarios on every rank
    return {
        "tp2_fsdp2": lambda: train_updates(data, *TP2_FSDP2),
        "tp2_fsdp2_flags": lambda: train_updates(data, *TP2_FSDP2, "--fsdp-forward-prefetch", "--fsdp-sync-free"),
        "hsdp2x2": lambda: train_updates(data, *HSDP2x2),
        "fsdp4": lambda: train_updates(data, *FSDP4),
        # TP 2 x DP 2 to 6 updates, keeping updates 2 and 4; from a copy of update 2, resumed to 4 on the same
        # layout and on DP 4.
        "uninterrupted": lambda: run_main(
            data, out / "uninterrupted", *TP2_FSDP2, *CHECKPOINTS, "--save-interval-updates", "2", "--max-update", "6"
        ),
        "copies_of_2": lambda: [
            _copy_checkpoint(out / "uninterrupted" / "checkpoint_1_2", out / d / "checkpoint_last")
            for d in ("tp2_dp2", "dp4")
        ],
        "resumed_tp2_dp2": lambda: run_main(data, out / "tp2_dp2", *TP2_FSDP2, *CHECKPOINTS, "--max-update", "4"),
        "resumed_dp4": lambda: run_main(data, out / "dp4", *FSDP4, *CHECKPOINTS, "--max-update", "4"),
    }


def _copy_checkpoint(src, dst):
    import shutil

    if dist.get_rank() == 0:
        shutil.copytree(src, dst)
    dist.barrier()


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_runs")
    return out, spawn_scenarios(scenarios, out, WORLD, tiny_data, out, timeout_s=120)


def result(runs, name, rank=0):
    value = runs[1][rank][name]
    if isinstance(value, Exception):
        raise value
    return value


@pytest.fixture(scope="module")
def one_process(tiny_data):
    return train_updates(tiny_data, *ONE_PROCESS)


def assert_close_states(got, want, atol=PARAM_ATOL, exact=False):
    assert got.keys() == want.keys()
    for key in got:
        if exact:
            assert torch.equal(got[key], want[key]), key
        elif not key.endswith(NOISE_ONLY):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=atol, msg=key)


@pytest.mark.parametrize("layout", ["tp2_fsdp2", "hsdp2x2", "fsdp4"])
def test_layout_trains_as_one_process(runs, one_process, layout):
    losses, state = result(runs, layout)
    ref_losses, ref_state = one_process
    assert len(losses) == len(ref_losses) == UPDATES
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (layout, losses, ref_losses)
    assert_close_states(state, ref_state)
    for rank in range(1, WORLD):  # every rank logged the same (data-parallel sums) losses
        assert result(runs, layout, rank)[0] == losses


def test_fsdp_flags_do_not_change_tensor_parallel_training(runs):
    plain, flags = result(runs, "tp2_fsdp2"), result(runs, "tp2_fsdp2_flags")
    assert plain[0] == flags[0]
    assert_close_states(flags[1], plain[1], exact=True)


# ------------------------------------------------------------------------ checkpoints across layouts


def consolidated_model(path):
    from fairseq.checkpoint.consolidate import read_full_state

    return read_full_state(str(path), keys=["model"])["model"]


def test_resume_on_the_same_layout_is_bitwise(runs):
    for name in ("uninterrupted", "copies_of_2", "resumed_tp2_dp2"):
        result(runs, name)
    out = runs[0]
    assert_close_states(
        consolidated_model(out / "tp2_dp2" / "checkpoint_last"),
        consolidated_model(out / "uninterrupted" / "checkpoint_1_4"),
        exact=True,
    )


def test_resume_on_another_layout(runs):
    """DP 4 continues TP 2 x DP 2's update-2 checkpoint: the same data position (8 batches in), the same
    model to the tolerance of a change of summation order (PARAM_ATOL, see the module docstring)."""
    result(runs, "resumed_dp4")
    out = runs[0]
    assert_close_states(
        consolidated_model(out / "dp4" / "checkpoint_last"),
        consolidated_model(out / "uninterrupted" / "checkpoint_1_4"),
    )


# ------------------------------------------------------------------ command lines: torchrun, megatron_11b

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def _check(proc, what):
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def eval_lm(data, path, *flags):
    """fairseq-eval-lm's result dict, in this process (one process: it loads any layout whole)."""
    from fairseq import options
    from fairseq_cli import eval_lm as cli

    args = options.parse_args_and_arch(options.get_eval_lm_parser(), [str(data), "--path", str(path), "--cpu", *flags])
    return cli.main(options.convert_namespace_to_config(args))


def test_torchrun_two_nodes_continue_on_tp2_dp1(runs, tiny_data, tmp_path):
    """TP 2 x DP 2 -> DP 4 -> TP 2 x DP 1: two torchrun agents on this machine (--nnodes 2, c10d rendezvous on
    localhost, one rank each) resume DP 4's update-4 checkpoint with --update-freq 4 (the same global batch)
    and reach update 6 as the uninterrupted TP 2 x DP 2 run did, with cross_entropy on gathered logits in
    place of the vocabulary-parallel loss (the same sums in another order). The result consolidates into one
    file that fairseq-eval-lm scores exactly as it scores the sharded directory."""
    import shutil
    import subprocess
    import sys

    result(runs, "resumed_dp4")
    out = runs[0]
    shutil.copytree(out / "dp4" / "checkpoint_last", tmp_path / "checkpoint_last")
    port = get_free_port("127.0.0.1")
    train = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{port}",
        "--rdzv-id",
        "tp-test",
        "-m",
        "fairseq_cli.train",
        str(tiny_data),
        *TRAINING,
        *MODEL,
        "--ddp-backend",
        "fully_sharded",
        "--model-parallel-size",
        "2",
        "--update-freq",
        "4",
        *CHECKPOINTS,
        "--max-update",
        "6",
        "--save-dir",
        str(tmp_path),
        "--criterion",
        "cross_entropy",
    ]
    agents = [
        subprocess.Popen(train, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()) for _ in range(2)
    ]
    for agent in agents:
        stdout, stderr = agent.communicate(timeout=300)
        _check(subprocess.CompletedProcess(train, agent.returncode, stdout, stderr), "torchrun agent")
    assert_close_states(
        consolidated_model(tmp_path / "checkpoint_last"), consolidated_model(out / "uninterrupted" / "checkpoint_last")
    )

    script = os.path.join(ROOT, "scripts", "consolidate_fsdp_shards.py")
    _check(
        subprocess.run(
            [sys.executable, script, str(tmp_path / "checkpoint_last"), str(tmp_path / "full.pt")],
            capture_output=True,
            text=True,
            timeout=120,
            env=_env(),
        ),
        "consolidate_fsdp_shards.py",
    )
    sharded = eval_lm(tiny_data, tmp_path / "checkpoint_last", "--tokens-per-sample", "32")
    single = eval_lm(tiny_data, tmp_path / "full.pt", "--tokens-per-sample", "32")
    assert sharded == single and sharded["tokens"] > 0


# upstream's examples/megatron_11b/README.md command lines, scaled down: --decoder-layers 2 and small dims,
# --model-parallel-size 2 on 2 processes, --max-update 4, --cpu (in place of --memory-efficient-fp16, which
# needs a GPU: --memory-efficient-bf16) and --num-workers 0 (starting worker processes costs ~10 s each on CPU).
MEGATRON_11B_TRAIN = [
    "--distributed-world-size",
    "2",
    "--memory-efficient-bf16",
    "--num-workers",
    "0",
    "--model-parallel-size",
    "2",
    "--criterion",
    "vocab_parallel_cross_entropy",
    "--task",
    "language_modeling",
    "--sample-break-mode",
    "none",
    "--tokens-per-sample",
    "32",
    "--arch",
    "transformer_lm_megatron_11b",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "32",
    "--decoder-ffn-embed-dim",
    "192",
    "--decoder-attention-heads",
    "4",
    "--share-decoder-input-output-embed",
    "--optimizer",
    "adam",
    "--adam-betas",
    "(0.9, 0.98)",
    "--adam-eps",
    "1e-08",
    "--clip-norm",
    "0.0",
    "--lr-scheduler",
    "inverse_sqrt",
    "--lr",
    "0.00015",
    "--warmup-updates",
    "3000",
    "--weight-decay",
    "0.01",
    "--dropout",
    "0.1",
    "--attention-dropout",
    "0.1",
    "--max-sentences",
    "2",
    "--max-update",
    "4",
    "--cpu",
]
MEGATRON_11B_EVAL = [
    "--task",
    "language_modeling",
    "--gen-subset",
    "test",
    "--max-sentences",
    "8",
    "--criterion",
    "cross_entropy",
    "--context-window",
    "16",
    "--distributed-world-size",
    "2",
    "--model-parallel-size",
    "2",
    "--tokens-per-sample",
    "32",
]


def test_megatron_11b_command_lines(tiny_data, tmp_path):
    from fairseq.logging.progress_bar import read_json_log

    argv = [str(tiny_data), *MEGATRON_11B_TRAIN, "--save-dir", str(tmp_path), "--log-format", "json"]
    argv += ["--log-interval", "1", "--log-file", str(tmp_path / "train.log")]
    status, out, err = train_in_process(argv)  # the 2 ranks spawned from this process
    assert status == 0, f"fairseq-train (megatron_11b) failed:\n{out[-3000:]}\n{err[-3000:]}"
    rows = read_json_log(tmp_path / "train.log")
    assert [int(r["num_updates"]) for r in rows] == [1, 2, 3, 4]
    state = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["model"]["decoder.embed_tokens.weight"].shape == (64, 32)  # whole, gathered from both ranks
    assert state["cfg"]["distributed_training"]["model_parallel_size"] == 2
    result = eval_lm(tiny_data, tmp_path / "checkpoint_last.pt", *MEGATRON_11B_EVAL)
    assert result["tokens"] > 0 and math.isfinite(result["loss"]) and result["perplexity"] == 2 ** result["loss"]
