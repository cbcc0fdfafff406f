"""fairseq-train on 2 CPU processes (gloo): DDP and fully_sharded against one process, the FSDP flags,
sharded checkpoints (resume on the same and on another world size), consolidation, simulated SLURM, torchrun.

The runs whose output the tests read, the SLURM tasks and torchrun are real `python -m fairseq_cli.train`
processes; the others run fairseq-train's entry point in this process, which spawns their ranks (the
one-process reference trains in this process too). Starting the processes of a run costs more than its
training, so runs that train the same thing are shared between tests (fsdp_runs, resharded). Dropout is 0 so that the only differences between layouts are
floating-point summation order.
"""

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from fairseq.logging.progress_bar import read_json_log
from tests.train_fixtures import tiny_train_argv, train_in_process

pytestmark = pytest.mark.timeout(900)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Summation order differs between one process accumulating two micro-batches and two ranks averaging
# gradients: a few fp32 ulps per step, compounded by Adam over a handful of updates.
ATOL = 2e-5


def _env(extra=None):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.update(extra or {})
    return env


# The tiny transformer_lm_gpt of these runs (tests/conftest.py) with no dropout and a short decaying schedule.
SCHEDULE = [
    "--dropout",
    "0",
    "--attention-dropout",
    "0",
    "--lr-scheduler",
    "polynomial_decay",
    "--warmup-updates",
    "2",
    "--total-num-update",
    "20",
    "--clip-norm",
    "0.5",
    "--required-batch-size-multiple",
    "1",
]


def train_argv(data, save_dir, *extra, max_update=6, validate=False):
    """fairseq-train's arguments for these runs: the tiny transformer_lm_gpt with SCHEDULE, --seed 5, a json
    --log-file in save_dir, --disable-validation unless `validate`; then `extra`."""
    return tiny_train_argv(
        data,
        save_dir,
        *SCHEDULE,
        "--heartbeat-timeout",
        "120",
        *([] if validate else ["--disable-validation"]),
        *extra,
        max_update=max_update,
        arch="transformer_lm_gpt",
        seed="5",
    )


@pytest.fixture(scope="session")
def run_train():
    """run_train(data, save_dir, *extra, world_size=1, max_update=6, env=None, check=True, validate=False,
    process=True): python -m fairseq_cli.train with train_argv's arguments; with process=False its entry point
    in this process (train_in_process: the ranks are spawned from here, their output is not returned)."""

    def run(data, save_dir, *extra, world_size=1, max_update=6, env=None, check=True, validate=False, process=True):
        argv = train_argv(data, save_dir, *extra, max_update=max_update, validate=validate)
        if world_size > 1:
            argv += ["--distributed-world-size", str(world_size)]
        if process:
            proc = subprocess.run(
                [sys.executable, "-m", "fairseq_cli.train", *argv],
                capture_output=True,
                text=True,
                timeout=600,
                env=_env(env),
            )
        else:
            assert env is None, "the environment is this process's"
            proc = subprocess.CompletedProcess(argv, *train_in_process(argv))
        if check and proc.returncode != 0:
            raise AssertionError(
                f"fairseq-train failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
        return proc

    return run


def losses(log_file):
    """{update: loss} of the log's train_inner lines."""
    return {int(row["num_updates"]): float(row["loss"]) for row in read_json_log(log_file)}


def model_state(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


# Softmax ignores a shift shared by all of a query's scores, so the key-projection bias gets a gradient that
# is zero up to rounding noise; Adam divides that noise by its own magnitude and moves the bias by about lr
# per step in a direction set by the noise. It is compared only where arithmetic is identical (exact=True).
NOISE_ONLY = (".self_attn.k_proj.bias",)


def assert_states_close(a, b, atol=ATOL, exact=False):
    assert a.keys() == b.keys()
    for k in a:
        if not exact and k.endswith(NOISE_ONLY):
            continue
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def single_reference(tiny_data, tmp_path_factory):
    """One process, two micro-batches per update: the same global batch as 2 ranks x 1 micro-batch. It trains
    in this process (on one thread, as the launched ranks do): what it is the reference for is the arithmetic,
    not a launch."""
    from fairseq_cli import train

    out = tmp_path_factory.mktemp("single")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train.cli_main(train_argv(tiny_data, out, "--update-freq", "2"))
    finally:
        torch.set_num_threads(threads)
    return out


def test_ddp_matches_single_process(tiny_data, tmp_path, single_reference, run_train):
    run_train(tiny_data, tmp_path, "--ddp-backend", "pytorch_ddp", world_size=2, process=False)
    assert_states_close(
        model_state(tmp_path / "checkpoint_last.pt"), model_state(single_reference / "checkpoint_last.pt")
    )
    ref, got = losses(single_reference / "train.log"), losses(tmp_path / "train.log")
    assert ref.keys() == got.keys() == set(range(1, 7))
    for k in ref:
        assert abs(ref[k] - got[k]) <= 0.0015, (k, ref[k], got[k])  # logged with 3 decimals


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_simulated_slurm_job(argv, port):
    """fairseq-train as the two tasks of a one-node SLURM job (no spawning: each task is a rank); the
    CompletedProcess of task 0, with both tasks' output."""
    procs = []
    for rank in range(2):
        env = _env(
            {
                "SLURM_JOB_ID": "4242",
                "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank),
                "SLURM_NTASKS": "2",
                "SLURM_NNODES": "1",
                "SLURM_NTASKS_PER_NODE": "2",
                "SLURM_JOB_NODELIST": "localhost",
                "SLURM_STEP_NODELIST": "localhost",
            }
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "fairseq_cli.train", *argv, "--distributed-port", port],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    return subprocess.CompletedProcess(argv, 0, "\n".join(outputs), "")


# The uninterrupted sharded run (fsdp_runs[(True, True)]) and its resumed copies: sharded saves every 3 updates,
# to update SHARDED_LAST.
SHARDED = ["--use-sharded-state", "--save-interval-updates", "3"]
SHARDED_LAST = 10
# fsdp_runs[(False, True)]: sharded saves and validation every 2 updates to 10, the best 2 kept.
KEEP_BEST = [
    "--use-sharded-state",
    "--validate-interval-updates",
    "2",
    "--save-interval-updates",
    "2",
    "--keep-best-checkpoints",
    "2",
    "--no-epoch-checkpoints",
]


@pytest.fixture(scope="module")
def fsdp_runs(tiny_data, tmp_path_factory, run_train):
    """fully_sharded on 2 ranks with each combination of --fsdp-forward-prefetch / --fsdp-sync-free, 6 updates;
    {(prefetch, sync_free): (save_dir, CompletedProcess)}. Three of the four runs do a second job, which saves
    launching it on its own (neither saving nor validating changes what training computes, which
    test_fsdp_flags_change_scheduling_not_arithmetic checks too):
    - (True, False) runs as a simulated 2-task SLURM job (test_simulated_slurm_job_trains_with_two_ranks);
    - (False, True) validates, saves sharded checkpoints every 2 updates and keeps the best 2 (KEEP_BEST), to
      update 10 (test_keep_best_sharded_checkpoints_on_two_ranks);
    - (True, True) saves sharded checkpoints (--use-sharded-state) every 3 updates and runs on to update 10:
      the uninterrupted run of test_sharded_checkpoint_resume_is_bitwise_and_reshards.
    The update-6 state of the last two is their directory checkpoint_1_6 (see fsdp_state)."""
    runs = {}
    for prefetch in (False, True):
        for sync_free in (False, True):
            out = tmp_path_factory.mktemp(f"fsdp_p{int(prefetch)}_s{int(sync_free)}")
            flags = ["--ddp-backend", "fully_sharded"]
            flags += ["--fsdp-forward-prefetch"] if prefetch else []
            flags += ["--fsdp-sync-free"] if sync_free else []
            if (prefetch, sync_free) == (True, False):
                proc = run_simulated_slurm_job(train_argv(tiny_data, out, *flags), str(_free_port()))
            elif (prefetch, sync_free) == (False, True):
                proc = run_train(tiny_data, out, *flags, *KEEP_BEST, world_size=2, max_update=10, validate=True)
            elif (prefetch, sync_free) == (True, True):
                proc = run_train(tiny_data, out, *flags, *SHARDED, world_size=2, max_update=SHARDED_LAST)
            else:
                proc = run_train(tiny_data, out, *flags, world_size=2, process=False)
            runs[(prefetch, sync_free)] = (out, proc)
    return runs


def sharded_model_state(directory):
    from fairseq.checkpoint.consolidate import read_full_state

    return read_full_state(str(directory), keys=["model"])["model"]


def fsdp_state(fsdp_runs, key):
    """(model state, {update: loss}) of fsdp_runs[key] after update 6."""
    out = fsdp_runs[key][0]
    if key[1]:  # sharded saves, to update 10
        return sharded_model_state(out / "checkpoint_1_6"), {
            k: v for k, v in losses(out / "train.log").items() if k <= 6
        }
    return model_state(out / "checkpoint_last.pt"), losses(out / "train.log")


def test_fully_sharded_matches_single_process(fsdp_runs, single_reference):
    state, _ = fsdp_state(fsdp_runs, (False, False))
    assert_states_close(state, model_state(single_reference / "checkpoint_last.pt"))


def test_simulated_slurm_job_trains_with_two_ranks(fsdp_runs, single_reference):
    state, _ = fsdp_state(fsdp_runs, (True, False))  # launched as a SLURM job
    assert_states_close(state, model_state(single_reference / "checkpoint_last.pt"))


def test_fsdp_flags_change_scheduling_not_arithmetic(fsdp_runs):
    base, base_losses = fsdp_state(fsdp_runs, (False, False))
    assert base_losses.keys() == set(range(1, 7))
    for key, (_, proc) in fsdp_runs.items():
        state, got = fsdp_state(fsdp_runs, key)
        assert_states_close(state, base, exact=True)
        assert got == base_losses
        if key[1]:
            assert "no CUDA streams on CPU" in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def resharded(tiny_data, tmp_path_factory, fsdp_runs, run_train):
    """The uninterrupted sharded run's update-3 checkpoint, resumed in one save dir: to update 6 on 2 ranks
    started by torchrun --nproc_per_node 2 (the issue's command shape, with both FSDP flags), then to 8 on 1
    rank (--update-freq 2: the same global batch), then to 10 on 2 ranks (spawned) again. (save_dir, the
    torchrun CompletedProcess)."""
    straight = fsdp_runs[(True, True)][0]
    out = tmp_path_factory.mktemp("resharded")
    shutil.copytree(straight / "checkpoint_1_3", out / "checkpoint_last")
    sharded = ["--ddp-backend", "fully_sharded", "--fsdp-forward-prefetch", "--fsdp-sync-free", *SHARDED]
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--master-port",
        str(_free_port()),
        "--nproc_per_node",
        "2",
        "-m",
        "fairseq_cli.train",
        *train_argv(tiny_data, out, *sharded, max_update=6),
    ]
    torchrun = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=_env())
    assert torchrun.returncode == 0, torchrun.stdout[-3000:] + torchrun.stderr[-3000:]
    run_train(tiny_data, out, *sharded, "--update-freq", "2", world_size=1, max_update=8, process=False)
    run_train(tiny_data, out, *sharded, world_size=2, max_update=SHARDED_LAST, process=False)
    return out, torchrun


def test_torchrun_fairseq_train_fully_sharded_with_both_flags(resharded):
    """The issue's command shape: torchrun --nproc_per_node 2 fairseq-train ... (CPU, gloo); the resharded
    fixture's first leg, which resumes an update-3 checkpoint to update 6."""
    out, torchrun = resharded
    assert "training on 2 device(s)" in torchrun.stdout + torchrun.stderr
    assert (out / "checkpoint_1_6" / "metadata.pt").is_file()


def test_sharded_checkpoint_resume_is_bitwise_and_reshards(tiny_data, tmp_path, single_reference, fsdp_runs, resharded):
    from fairseq.checkpoint.consolidate import consolidate

    straight, (resumed, _) = fsdp_runs[(True, True)][0], resharded
    assert (straight / "checkpoint_last").is_dir() and not (straight / "checkpoint_last.pt").exists()
    straight_losses, resumed_losses = losses(straight / "train.log"), losses(resumed / "train.log")
    assert straight_losses.keys() == set(range(1, SHARDED_LAST + 1))
    assert resumed_losses.keys() == set(range(4, SHARDED_LAST + 1))
    # Same world size: the resumed run logs exactly the uninterrupted run's losses and reaches its parameters.
    assert {k: resumed_losses[k] for k in (4, 5, 6)} == {k: straight_losses[k] for k in (4, 5, 6)}
    assert_states_close(
        sharded_model_state(resumed / "checkpoint_1_6"), sharded_model_state(straight / "checkpoint_1_6"), exact=True
    )

    # Consolidated, the sharded checkpoint equals the single-process run's parameters...
    consolidated = tmp_path / "consolidated.pt"
    consolidate(str(straight / "checkpoint_1_6"), str(consolidated))
    assert_states_close(model_state(consolidated), model_state(single_reference / "checkpoint_last.pt"))

    # ... and fairseq-eval-lm gives the same loss from the directory and from the consolidated file.
    def eval_loss(path):
        from fairseq import options
        from fairseq_cli import eval_lm

        args = options.parse_args_and_arch(
            options.get_eval_lm_parser(),
            [
                str(tiny_data),
                "--path",
                str(path),
                "--gen-subset",
                "test",
                "--tokens-per-sample",
                "32",
                "--batch-size",
                "4",
                "--cpu",
            ],
        )
        return eval_lm.main(options.convert_namespace_to_config(args))["loss"]

    assert eval_loss(straight / "checkpoint_1_6") == eval_loss(consolidated)

    # 2 ranks -> 1 rank (updates 7, 8) and 1 rank -> 2 ranks (9, 10): training continues from the resharded
    # state; the same global batch, so only summation order differs.
    for k in range(7, SHARDED_LAST + 1):
        assert abs(resumed_losses[k] - straight_losses[k]) <= 0.002, (k, resumed_losses[k], straight_losses[k])


def test_a_resume_on_another_world_size_is_said_once(tiny_data, tmp_path, run_train):
    """The resume lines come from rank 0 alone (the world-size warning came from every rank)."""
    run_train(tiny_data, tmp_path, world_size=1, max_update=3, process=False)
    proc = run_train(tiny_data, tmp_path, world_size=2, max_update=4)  # every rank's output
    lines = (proc.stdout + proc.stderr).splitlines()
    assert (
        len([line for line in lines if "resuming a checkpoint saved by 1 ranks on 2: continuing after batch 3" in line])
        == 1
    )
    assert len([line for line in lines if "loaded checkpoint" in line]) == 1


def test_keep_best_sharded_checkpoints_on_two_ranks(fsdp_runs):
    """--keep-best-checkpoints with sharded saves on 2 ranks (fsdp_runs' sync-free run): the decision is
    broadcast from rank 0 and the kept directories are complete (the selection rule itself:
    tests/unit/test_checkpoint_paths.py)."""
    out = fsdp_runs[(False, True)][0]
    valid = [float(row["valid_loss"]) for row in read_json_log(out / "train.log", "valid")]
    assert len(valid) == 5
    kept = sorted(n for n in os.listdir(out) if n.startswith("checkpoint.best_loss_"))
    assert len(kept) == 2
    assert all(os.path.isfile(out / n / ".metadata") for n in kept)  # complete DCP directories
    values = sorted(float(n[len("checkpoint.best_loss_") :]) for n in kept)
    # names carry 4 decimals, the log 3: equal within the two roundings
    assert all(abs(v - w) <= 6e-4 for v, w in zip(values, sorted(valid)[:2])), (values, valid)


def test_a_failing_rank_fails_the_whole_job(tiny_data, tmp_path, run_train, faulty_criterion):
    plugin = faulty_criterion("fail_plugin", "fails_on_rank1", call=3, rank=1, error="rank 1 broke on purpose")
    proc = run_train(
        tiny_data,
        tmp_path / "ck",
        "--user-dir",
        str(plugin),
        "--criterion",
        "fails_on_rank1",
        "--heartbeat-timeout",
        "20",
        "--ddp-backend",
        "fully_sharded",
        world_size=2,
        check=False,
    )
    assert proc.returncode != 0
    assert "rank 1 broke on purpose" in proc.stdout + proc.stderr
