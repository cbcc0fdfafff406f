"""A tiny corpus writer, fairseq-train command lines for tiny models, --user-dir plug-in directories, and
console entry points run in the test process (the fixtures in tests/conftest.py hand some out; test modules
may import them directly)."""

import gc
import os
import random
import subprocess

import torch


def write_corpus(path, num_lines, seed, vocab=60, min_len=3, max_len=25):
    """Deterministic pseudo-text: words drawn from a skewed vocabulary so a model can learn something."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab)]
    weights = [1.0 / (i + 1) for i in range(vocab)]
    with open(path, "w") as f:
        for _ in range(num_lines):
            n = rng.randint(min_len, max_len)
            f.write(" ".join(rng.choices(words, weights, k=n)) + "\n")


# ----------------------------------------------------------------------------- fairseq-train command lines

# Two tiny decoders ("transformer_lm": 2 layers of 32, tied embeddings with 32-wide input and output; a 2-layer
# "transformer_lm_gpt" of 32), with the learning rate and batch shape the tests train them with by default.
TINY_MODELS = {
    "transformer_lm": {
        "model": [
            "--arch",
            "transformer_lm",
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
            "--share-decoder-input-output-embed",
        ],
        "lr": "0.002",
        "batch": ["--max-tokens", "256"],
    },
    "transformer_lm_gpt": {
        "model": [
            "--arch",
            "transformer_lm_gpt",
            "--decoder-layers",
            "2",
            "--decoder-embed-dim",
            "32",
            "--decoder-ffn-embed-dim",
            "64",
            "--decoder-attention-heads",
            "2",
        ],
        "lr": "0.003",
        "batch": ["--batch-size", "4"],
    },
}

# What `train_args` adds: regularisation and a warmed-up schedule, blocks across sentence boundaries.
TRAIN_RECIPE = [
    "--dropout",
    "0.1",
    "--adam-betas",
    "(0.9, 0.98)",
    "--weight-decay",
    "0.01",
    "--clip-norm",
    "1.0",
    "--lr-scheduler",
    "inverse_sqrt",
    "--warmup-updates",
    "4",
    "--sample-break-mode",
    "none",
]


def tiny_train_argv(
    data, save_dir, *extra, max_update, arch="transformer_lm", lr=None, seed="3", json_log=True, log_file=True
):
    """fairseq-train's arguments (no program name) for the tiny `arch` on `data`, on the CPU: adam at `lr`
    (default: the model's), --tokens-per-sample 32, the model's --max-tokens or --batch-size, --num-workers 0,
    --seed `seed` (None: no --seed), with json_log --log-format json --log-interval 1, with log_file
    --log-file SAVE_DIR/train.log; then `extra`."""
    preset = TINY_MODELS[arch]
    argv = [
        "--task",
        "language_modeling",
        str(data),
        "--save-dir",
        str(save_dir),
        *preset["model"],
        "--optimizer",
        "adam",
        "--lr",
        preset["lr"] if lr is None else lr,
        "--tokens-per-sample",
        "32",
        *preset["batch"],
        "--max-update",
        str(max_update),
        "--num-workers",
        "0",
        "--cpu",
    ]
    if seed is not None:
        argv += ["--seed", seed]
    if json_log:
        argv += ["--log-format", "json", "--log-interval", "1"]
    if log_file:
        argv += ["--log-file", os.path.join(str(save_dir), "train.log")]
    return argv + list(extra)


def default_train_argv(data, save_dir, *extra, max_update=8):
    """The tiny transformer_lm with TRAIN_RECIPE, --seed 3, a json --log-file in save_dir."""
    return tiny_train_argv(data, save_dir, *TRAIN_RECIPE, *extra, max_update=max_update)


def write_plugin(directory, source):
    """The --user-dir plug-in `directory` (created; its name is the module's) with `source` as __init__.py."""
    directory.mkdir()
    (directory / "__init__.py").write_text(source)
    return directory


# ----------------------------------------------------------------------------- command lines in this process


def console_in_process(name, cli_main, argv):
    """What the console script `name` (`cli_main` under fairseq.utils.run_console_script) does with `argv`: the
    log on stdout, a user error as one `NAME: error:` line on stderr and exit status 1, a usage error status 2;
    run in this process on one intra-op thread (ranks it spawns get OMP_NUM_THREADS=1, as the tests' own
    processes do). Returns (exit status, stdout, stderr). Starting a Python process with torch costs seconds,
    more than the tiny runs of the tests; tests that are about the process itself (signals, torchrun/SLURM
    launches, resource limits, the installed script) start one instead. --distributed-world-size N spawns its
    N ranks from this process: real gloo processes, without a launcher process of their own (their log is
    not in the stdout returned: read their --log-file)."""
    import contextlib
    import io
    import logging

    import torch

    from fairseq.logging.progress_bar import make_formatter
    from fairseq.utils import run_console_script

    import torch.distributed as dist

    had_process_group = dist.is_initialized()
    out, err = io.StringIO(), io.StringIO()
    log = logging.StreamHandler(out)  # where the process's root logger writes (progress_bar.setup_logging)
    log.setFormatter(make_formatter())
    root = logging.getLogger()
    threads, level, omp = torch.get_num_threads(), root.level, os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    root.addHandler(log)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_console_script(name, cli_main, argv)
        status = 0
    except SystemExit as exit:  # as the interpreter ends on it: None is 0, a message is printed with status 1
        status = 0 if exit.code is None else exit.code if isinstance(exit.code, int) else 1
        if not isinstance(exit.code, (int, type(None))):
            err.write(f"{exit.code}\n")
    finally:
        root.removeHandler(log)
        root.setLevel(level)
        torch.set_num_threads(threads)
        if omp is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = omp
        if not had_process_group and dist.is_initialized():  # the process would have ended with its group
            gc.collect()  # cycles still holding the group first, as the launcher does (else gloo may abort the exit)
            dist.destroy_process_group()
    return status, out.getvalue(), err.getvalue()


def train_in_process(argv):
    """`fairseq-train ARGV` in this process (console_in_process)."""
    from fairseq_cli import train

    return console_in_process("fairseq-train", train.cli_main, argv)


# ----------------------------------------------------------------------------- spawned gloo scenarios


def _scenario_worker(rank, world, port, timeout_s, out_dir, make_scenarios, args):
    import traceback
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    torch.set_num_threads(1)
    results = {}
    try:
        for name, scenario in make_scenarios(rank, *args).items():
            try:
                results[name] = scenario()
            except Exception:  # kept, so that every scenario runs and each test reports its own failure
                results[name] = RuntimeError(f"rank {rank}, scenario {name}:\n{traceback.format_exc()}")
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        # reference cycles that still hold the group go first, as the launcher does: gloo's threads otherwise
        # abort the exit (SIGABRT, "terminate called without an active exception") about one run in three
        results = None
        gc.collect()
        dist.destroy_process_group()


def spawn_scenarios(make_scenarios, out_dir, world, *args, timeout_s=60):
    """Spawn `world` gloo ranks once (spawn_ranks); each runs the scenarios of `make_scenarios(rank, *args)`
    ({name: callable without arguments}, in order) and saves their results (or the exception of a failed one).
    Returns each rank's {name: result}. `make_scenarios` must be a module-level function (the ranks are new
    processes)."""
    from fairseq.runtime.env import get_free_port

    spawn_ranks(
        _scenario_worker, world, world, get_free_port("127.0.0.1"), timeout_s, str(out_dir), make_scenarios, args
    )
    return [torch.load(os.path.join(str(out_dir), f"rank{r}.pt"), weights_only=False) for r in range(world)]


# What the ranks import, imported once by multiprocessing's forkserver (one per test process): a rank forked
# from it starts at once, where a spawned interpreter spends ~2-3 s of CPU importing torch, fairseq, and what
# training loads on first use (dynamo, FSDP2, DCP, DTensor), more than the tiny scenarios themselves cost.
FORKSERVER_PRELOAD = [
    "torch",
    "fairseq_cli.train",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "tests.train_fixtures",
]


def _in_environment(rank, env, fn, args):
    os.environ.clear()  # the forkserver's is the environment of the test process when it started
    os.environ.update(env)
    fn(rank, *args)


def spawn_ranks(fn, nprocs, *args):
    """What torch.multiprocessing.spawn(fn, args, nprocs) does (fn(rank, *args) in `nprocs` new processes,
    joined, a failure raised here), with the processes forked from a forkserver that has imported
    FORKSERVER_PRELOAD, and this process's environment as theirs (os.environ now, as a spawned process gets).
    `fn` must be a module-level function."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the forkserver runs
    mp.start_processes(
        _in_environment, args=(dict(os.environ), fn, args), nprocs=nprocs, join=True, start_method="forkserver"
    )


def assert_same_model_and_optimizer(a, b):
    """Two checkpoint states hold bitwise the same weights and optimizer state."""
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for name, state in a["last_optimizer_state"]["state"].items():
        for k, v in state.items():
            assert torch.equal(v, b["last_optimizer_state"]["state"][name][k]), (name, k)


def assert_group_gone(pgid: int, within: float = 5.0) -> None:
    """No process of the group `pgid` (a command started with `start_new_session=True`) is left once `within`
    seconds have passed: workers are reaped before the command exits, and multiprocessing's forkserver exits
    when it sees its parent gone (at once, but after the parent)."""
    import signal
    import time

    deadline = time.time() + within
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    left = subprocess.run(["ps", "-o", "pid,args", "-g", str(pgid)], capture_output=True, text=True).stdout
    os.killpg(pgid, signal.SIGKILL)
    raise AssertionError(f"processes of the command outlived it by {within} s:\n{left}")


def interrupt_once(proc, sig: str, mid_run, what: str):
    """Start-of-signal tests for a command started with `start_new_session=True`: wait (at most 60 s) until
    `mid_run()` is true, send `sig` once (SIGINT to the process group, as Ctrl-C does; SIGTERM to the main
    process, as a scheduler does), and return (signal number, seconds until the process ended, its stderr).
    The process group is killed if it outlives the test."""
    import signal
    import time

    try:
        deadline = time.time() + 60
        while time.time() < deadline and not mid_run():
            time.sleep(0.002)
        assert proc.poll() is None, f"{what} finished before it could be interrupted"
        signum = getattr(signal, sig)
        os.killpg(proc.pid, signum) if sig == "SIGINT" else os.kill(proc.pid, signum)
        start = time.time()
        _, stderr = proc.communicate(timeout=30)
        return signum, time.time() - start, stderr
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def train_until(cfg, trainer, epoch_itr, num_updates):
    """Upstream's train() through its Trainer API: the epoch's batches in updates of --update-freq, stopping at
    `num_updates`; returns the batch iterator (positioned after the last update)."""
    from fairseq.data.iterators import GroupedIterator

    shuffle = epoch_itr.next_epoch_idx > cfg.dataset.curriculum
    itr = GroupedIterator(epoch_itr.next_epoch_itr(shuffle=shuffle), cfg.optimization.update_freq[0])
    trainer.begin_epoch(epoch_itr.epoch)
    for samples in itr:
        trainer.train_step(samples, epoch_itr)
        if trainer.get_num_updates() >= num_updates:
            break
    return itr
