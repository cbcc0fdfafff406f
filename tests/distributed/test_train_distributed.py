"""fairseq-train on 2 CPU processes (gloo): DDP and fully_sharded against one process, the FSDP flags,
sharded checkpoints (resume on the same and on another world size), consolidation, simulated SLURM.

Each run is a real `python -m fairseq_cli.train` subprocess. Dropout is 0 so that the only differences
between layouts are floating-point summation order.
"""

import os
import socket
import subprocess
import sys

import pytest
import torch

from fairseq.logging.progress_bar import read_json_log

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
SCHEDULE = ["--dropout", "0", "--attention-dropout", "0", "--lr-scheduler", "polynomial_decay", "--warmup-updates",
            "2", "--total-num-update", "20", "--clip-norm", "0.5", "--required-batch-size-multiple", "1"]


@pytest.fixture(scope="session")
def run_train(build_train_args):
    """run_train(data, save_dir, *extra, world_size=1, max_update=6, env=None, check=True, validate=False):
    python -m fairseq_cli.train with SCHEDULE, --seed 5 and a json --log-file in save_dir."""
    def run(data, save_dir, *extra, world_size=1, max_update=6, env=None, check=True, validate=False):
        argv = build_train_args(data, save_dir, *SCHEDULE, "--heartbeat-timeout", "120",
                                *([] if validate else ["--disable-validation"]), *extra, max_update=max_update,
                                arch="transformer_lm_gpt", seed="5")
        if world_size > 1:
            argv += ["--distributed-world-size", str(world_size)]
        proc = subprocess.run([sys.executable, "-m", "fairseq_cli.train", *argv], capture_output=True, text=True,
                              timeout=600, env=_env(env))
        if check and proc.returncode != 0:
            raise AssertionError(
                f"fairseq-train failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
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
def single_reference(tiny_data, tmp_path_factory, run_train):
    """One process, two micro-batches per update: the same global batch as 2 ranks x 1 micro-batch."""
    out = tmp_path_factory.mktemp("single")
    run_train(tiny_data, out, "--update-freq", "2")
    return out


def test_ddp_matches_single_process(tiny_data, tmp_path, single_reference, run_train):
    run_train(tiny_data, tmp_path, "--ddp-backend", "pytorch_ddp", world_size=2)
    assert_states_close(model_state(tmp_path / "checkpoint_last.pt"),
                        model_state(single_reference / "checkpoint_last.pt"))
    ref, got = losses(single_reference / "train.log"), losses(tmp_path / "train.log")
    assert ref.keys() == got.keys() == set(range(1, 7))
    for k in ref:
        assert abs(ref[k] - got[k]) <= 0.0015, (k, ref[k], got[k])  # logged with 3 decimals


@pytest.fixture(scope="module")
def fsdp_runs(tiny_data, tmp_path_factory, run_train):
    """fully_sharded on 2 ranks with each combination of --fsdp-forward-prefetch / --fsdp-sync-free."""
    runs = {}
    for prefetch in (False, True):
        for sync_free in (False, True):
            out = tmp_path_factory.mktemp(f"fsdp_p{int(prefetch)}_s{int(sync_free)}")
            flags = ["--ddp-backend", "fully_sharded"]
            flags += ["--fsdp-forward-prefetch"] if prefetch else []
            flags += ["--fsdp-sync-free"] if sync_free else []
            proc = run_train(tiny_data, out, *flags, world_size=2)
            runs[(prefetch, sync_free)] = (out, proc)
    return runs


def test_fully_sharded_matches_single_process(fsdp_runs, single_reference):
    out, _ = fsdp_runs[(False, False)]
    assert_states_close(model_state(out / "checkpoint_last.pt"), model_state(single_reference / "checkpoint_last.pt"))


def test_fsdp_flags_change_scheduling_not_arithmetic(fsdp_runs):
    base = model_state(fsdp_runs[(False, False)][0] / "checkpoint_last.pt")
    base_losses = losses(fsdp_runs[(False, False)][0] / "train.log")
    for key, (out, proc) in fsdp_runs.items():
        assert_states_close(model_state(out / "checkpoint_last.pt"), base, exact=True)
        assert losses(out / "train.log") == base_losses
        if key[1]:
            assert "no CUDA streams on CPU" in proc.stdout + proc.stderr


def test_sharded_checkpoint_resume_is_bitwise_and_reshards(tiny_data, tmp_path, single_reference, run_train):
    sharded = ["--ddp-backend", "fully_sharded", "--use-sharded-state", "--fsdp-forward-prefetch",
               "--fsdp-sync-free"]
    straight = tmp_path / "straight"
    run_train(tiny_data, straight, *sharded, world_size=2, max_update=6)
    resumed = tmp_path / "resumed"
    run_train(tiny_data, resumed, *sharded, world_size=2, max_update=3)
    assert (resumed / "checkpoint_last").is_dir() and not (resumed / "checkpoint_last.pt").exists()
    run_train(tiny_data, resumed, *sharded, world_size=2, max_update=6)
    assert losses(straight / "train.log") == losses(resumed / "train.log")

    # Consolidated, the sharded checkpoint equals the single-process run's parameters...
    consolidated = tmp_path / "consolidated.pt"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "consolidate_fsdp_shards.py"),
                    str(straight / "checkpoint_last"), str(consolidated)], check=True, env=_env(), timeout=300)
    resumed_state = model_state(consolidated)
    assert_states_close(resumed_state, model_state(single_reference / "checkpoint_last.pt"))

    # ... and fairseq-eval-lm gives the same perplexity from the directory and from the consolidated file.
    def ppl(path):
        proc = subprocess.run([sys.executable, "-m", "fairseq_cli.eval_lm", str(tiny_data), "--path", str(path),
                               "--gen-subset", "test", "--tokens-per-sample", "32", "--batch-size", "4", "--cpu"],
                              capture_output=True, text=True, env=_env(), timeout=300, check=True)
        line = [l for l in (proc.stdout + proc.stderr).splitlines() if "Perplexity" in l][-1]
        return line.split("Loss (base 2):")[1]

    assert ppl(straight / "checkpoint_last") == ppl(consolidated)

    # 2 ranks -> 1 rank and 1 rank -> 2 ranks: training continues from the resharded state.
    two_to_one = tmp_path / "two_to_one"
    os.makedirs(two_to_one)
    subprocess.run(["cp", "-r", str(resumed / "checkpoint_last"), str(two_to_one / "checkpoint_last")], check=True)
    run_train(tiny_data, two_to_one, *sharded, "--update-freq", "2", world_size=1, max_update=8)
    one = losses(two_to_one / "train.log")
    assert set(one) == {7, 8}
    run_train(tiny_data, straight, *sharded, world_size=2, max_update=8)
    two = losses(straight / "train.log")
    for k in (7, 8):  # same global batch (1 rank x 2 micro-batches): only summation order differs
        assert abs(one[k] - two[k]) <= 0.002, (k, one[k], two[k])
    one_to_two = tmp_path / "one_to_two"
    run_train(tiny_data, one_to_two, *sharded, "--update-freq", "2", world_size=1, max_update=3)
    run_train(tiny_data, one_to_two, *sharded, world_size=2, max_update=6)
    got = losses(one_to_two / "train.log")
    ref = losses(resumed / "train.log")
    for k in range(1, 7):
        assert abs(got[k] - ref[k]) <= 0.002, (k, got[k], ref[k])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_keep_best_sharded_checkpoints_on_two_ranks(tiny_data, tmp_path, run_train):
    """--keep-best-checkpoints with sharded saves on 2 ranks: the decision is broadcast from rank 0 and
    the kept directories are complete (the selection rule itself: tests/unit/test_checkpoint_paths.py)."""
    run_train(tiny_data, tmp_path, "--ddp-backend", "fully_sharded", "--use-sharded-state",
              "--validate-interval-updates", "2", "--save-interval-updates", "2", "--keep-best-checkpoints", "2",
              "--no-epoch-checkpoints", world_size=2, max_update=10, validate=True)
    valid = [float(row["valid_loss"]) for row in read_json_log(tmp_path / "train.log", "valid")]
    assert len(valid) == 5
    kept = sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint.best_loss_"))
    assert len(kept) == 2
    assert all(os.path.isfile(tmp_path / n / ".metadata") for n in kept)  # complete DCP directories
    values = sorted(float(n[len("checkpoint.best_loss_"):]) for n in kept)
    # names carry 4 decimals, the log 3: equal within the two roundings
    assert all(abs(v - w) <= 6e-4 for v, w in zip(values, sorted(valid)[:2])), (values, valid)


def test_simulated_slurm_job_trains_with_two_ranks(tiny_data, tmp_path, single_reference, build_train_args):
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = _env({
            "SLURM_JOB_ID": "4242", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2",
            "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost",
            "SLURM_STEP_NODELIST": "localhost",
        })
        argv = [sys.executable, "-m", "fairseq_cli.train",
                *build_train_args(tiny_data, tmp_path, *SCHEDULE, "--disable-validation", "--distributed-port", port,
                                  "--heartbeat-timeout", "120", "--ddp-backend", "fully_sharded", max_update=6,
                                  arch="transformer_lm_gpt", seed="5", json_log=False, log_file=False)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert_states_close(model_state(tmp_path / "checkpoint_last.pt"),
                        model_state(single_reference / "checkpoint_last.pt"))


def test_a_failing_rank_fails_the_whole_job(tiny_data, tmp_path, run_train, faulty_criterion):
    plugin = faulty_criterion("fail_plugin", "fails_on_rank1", call=3, rank=1, error="rank 1 broke on purpose")
    proc = run_train(tiny_data, tmp_path / "ck", "--user-dir", str(plugin), "--criterion", "fails_on_rank1",
                     "--heartbeat-timeout", "20", "--ddp-backend", "fully_sharded", world_size=2, check=False)
    assert proc.returncode != 0
    assert "rank 1 broke on purpose" in proc.stdout + proc.stderr


def test_torchrun_fairseq_train_fully_sharded_with_both_flags(tiny_data, tmp_path, build_train_args):
    """The issue's command shape: torchrun --nproc_per_node 2 fairseq-train ... (CPU, gloo)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--master-port", str(_free_port()),
            "--nproc_per_node", "2", "-m", "fairseq_cli.train",
            *build_train_args(tiny_data, tmp_path, "--disable-validation", "--ddp-backend", "fully_sharded",
                              "--fsdp-forward-prefetch", "--fsdp-sync-free", "--use-sharded-state",
                              "--heartbeat-timeout", "120", max_update=3, arch="transformer_lm_gpt", seed=None,
                              json_log=False, log_file=False)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "checkpoint_last" / "metadata.pt").is_file()
