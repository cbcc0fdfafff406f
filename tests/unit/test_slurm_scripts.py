"""SLURM scripts of the large-LM recipes: the sbatch parses, slurm_submit.py renders and submits what is
expected, the batch shell forwards USR1 to the srun step and waits for it, and the README's fairseq-train
commands are the renderer's output."""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "examples" / "large_lm" / "slurm"
STATIC_SBATCH = SLURM_DIR / "train.sbatch"
README = REPO / "examples" / "large_lm" / "README.md"


def load_script(name):
    """A module of scripts/ (not a package), imported by path."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def slurm_submit():
    return load_script("slurm_submit")


def bash_syntax_ok(path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return True


def sbatch_lines(script):
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def render(slurm_submit, capsys, *argv):
    code = slurm_submit.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_static_sbatch_is_the_template_with_defaults_and_parses(slurm_submit):
    assert STATIC_SBATCH.read_text() == slurm_submit.render_static()
    assert bash_syntax_ok(STATIC_SBATCH)
    assert os.access(STATIC_SBATCH, os.X_OK)


def test_dry_run_175b_renders_the_job(slurm_submit, capsys, tmp_path):
    code, script, err = render(
        slurm_submit,
        capsys,
        "175b",
        "--nodes",
        "128",
        "--gpus-per-node",
        "8",
        "--dry-run",
        "--save-dir",
        str(tmp_path / "ck"),
        "--partition",
        "learn",
        "--time",
        "72:00:00",
    )
    assert code == 0, err
    lines = sbatch_lines(script)
    for expected in (
        "#SBATCH --nodes=128",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --signal=B:USR1@180",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        "#SBATCH --partition=learn",
        "#SBATCH --time=72:00:00",
        "#SBATCH --job-name=lm-175b",
        f"#SBATCH --output={tmp_path / 'ck'}/%x-%j.out",
        f"#SBATCH --error={tmp_path / 'ck'}/%x-%j.err",
    ):
        assert expected in lines
    assert "SIZE=175b" in script.splitlines()
    assert 'fairseq-hydra-train --config-dir "$CONFIG_DIR" --config-name "$SIZE"' in script
    assert "srun --kill-on-bad-exit=1" in script
    assert '"distributed_training.distributed_port=$PORT"' in script
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=" in script and "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}" in script
    assert "NCCL_NVLS_ENABLE=" not in script  # never turned on (or off) by the script
    assert "trap 'forward_signal USR1' USR1" in script
    assert "OVERRIDES=()" in script  # 128 x 8 is the recipe's own GPU count: nothing to adjust
    assert "no --data" in err and "DATA=${DATA:?" in script
    assert not (tmp_path / "ck").exists()  # a dry run writes nothing
    path = tmp_path / "rendered.sbatch"
    path.write_text(script)
    assert bash_syntax_ok(path)


def test_streaming_recipe_renders_with_its_data_and_tokenizer_files(slurm_submit, capsys):
    gpt2 = ["bpe.gpt2_encoder_json=/gpt2/encoder.json", "bpe.gpt2_vocab_bpe=/gpt2/vocab.bpe"]
    code, script, err = render(
        slurm_submit, capsys, "66b_streaming", "--nodes", "64", "--gpus-per-node", "8", "--dry-run", *gpt2
    )
    assert code == 0, err
    assert "SIZE=66b_streaming" in script.splitlines() and f"OVERRIDES=({' '.join(gpt2)})" in script
    assert "no --data" in err and "DATA=${DATA:?" in script  # the JSONL directory, from the environment


def test_other_gpu_counts_keep_the_global_batch(slurm_submit, capsys):
    code, script, err = render(
        slurm_submit,
        capsys,
        "175b",
        "--nodes",
        "32",
        "--gpus-per-node",
        "8",
        "--dry-run",
        "--data",
        "/data/bin",
        "optimization.lr=[6e-05]",
    )
    assert code == 0, err
    assert "OVERRIDES=('optimization.update_freq=[4]' 'optimization.lr=[6e-05]')" in script
    assert "keeps the global batch at 2,097,152 tokens" in err
    assert "DATA=/data/bin" in script.splitlines()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["175b", "--nodes", "3", "--gpus-per-node", "8", "--data", "/d"],
            "no update_freq gives the recipe's global batch",
        ),
        (
            ["125m", "--nodes", "1", "--gpus-per-node", "8", "--data", "/d", "optimization.lrr=[1]"],
            "unknown key 'optimization.lrr'",
        ),
        (["125m", "--nodes", "1", "--gpus-per-node", "8", "--data", "/d", "--save-dir", "/a b"], "with spaces"),
    ],
)
def test_bad_requests_fail_before_anything_is_written(slurm_submit, capsys, argv, message):
    code, out, err = render(slurm_submit, capsys, *argv, "--dry-run")
    assert code == 1 and message in err and out == ""


def test_unknown_size_is_a_usage_error(slurm_submit, capsys):
    with pytest.raises(SystemExit) as exit_info:
        slurm_submit.main(["9b", "--nodes", "1", "--gpus-per-node", "8", "--dry-run"])
    assert exit_info.value.code == 2
    assert "no recipe '9b'" in capsys.readouterr().err


def _stand_in(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def test_submission_runs_sbatch_on_the_rendered_file(slurm_submit, capsys, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stand_in(bin_dir, "sbatch", f'echo "$@" > {tmp_path}/sbatch_args\necho "Submitted batch job 123"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    save_dir = tmp_path / "save"
    code, out, err = render(
        slurm_submit,
        capsys,
        "1.3b",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--data",
        str(tmp_path / "data"),
        "--save-dir",
        str(save_dir),
    )
    assert code == 0, err
    script_path = save_dir / "lm-1.3b.sbatch"
    assert (tmp_path / "sbatch_args").read_text().split() == [str(script_path)]
    assert "Submitted batch job 123" in out and f"{save_dir}/lm-1.3b-123.out" in out
    assert "#SBATCH --nodes=4" in sbatch_lines(script_path.read_text())
    assert bash_syntax_ok(script_path)


def test_submission_without_sbatch_says_so(slurm_submit, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    code, _, err = render(
        slurm_submit,
        capsys,
        "125m",
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        "--data",
        "/d",
        "--save-dir",
        str(tmp_path / "save"),
    )
    assert code == 1 and "sbatch is not on PATH" in err and "--dry-run" in err


@pytest.mark.parametrize("exit_delay", [0.0, 0.6])
def test_batch_shell_forwards_usr1_to_srun_and_waits_for_it(tmp_path, exit_delay):
    # A stand-in srun: records its arguments, and on USR1 "saves" for exit_delay seconds, then exits 3 as the
    # trainer does after requeueing. The batch shell must forward the signal, wait, and exit 3 itself.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stand_in(
        bin_dir,
        "srun",
        f"""echo "$@" > {tmp_path}/srun_args
stop=0
trap 'echo USR1 >> {tmp_path}/srun_signals; stop=1' USR1
touch {tmp_path}/srun_started
while [ "$stop" = 0 ]; do sleep 0.05; done
sleep {exit_delay}
echo saved > {tmp_path}/srun_done
exit 3
""",
    )
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_SUBMIT_DIR=str(REPO),
        SAVE_DIR=str(tmp_path / "save"),
        DATA="/data/bin",
    )
    job = subprocess.Popen(
        ["bash", str(STATIC_SBATCH), "optimization.lr=[1e-4]"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 10
        while not (tmp_path / "srun_started").exists() and time.time() < deadline:
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)
        out, _ = job.communicate(timeout=10)
    finally:  # a broken script may leave the stand-in srun running: end the whole session it started
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.wait()
    assert job.returncode == 3, out
    assert (tmp_path / "srun_signals").read_text().split() == ["USR1"]
    assert (tmp_path / "srun_done").exists()  # the shell waited for the step to finish
    args = (tmp_path / "srun_args").read_text().split()
    assert args[:6] == [
        "--kill-on-bad-exit=1",
        "fairseq-hydra-train",
        "--config-dir",
        f"{REPO}/examples/large_lm/config",
        "--config-name",
        "125m",
    ]
    assert args[6:] == [
        f"hydra.run.dir={tmp_path}/save/hydra/4242",
        f"checkpoint.save_dir={tmp_path}/save",
        "distributed_training.distributed_port=14242",
        "task.data=/data/bin",
        "optimization.lr=[1e-4]",
    ]
    assert "preempted: checkpoint_last saved" in out


def test_readme_commands_are_the_rendered_ones(monkeypatch):
    render_train_command = load_script("render_train_command")
    # Each recipe composed once (hydra takes ~0.4 s a recipe), for the section and for the checks below.
    rendered = {size: render_train_command.train_command(size) for size in render_train_command.SIZES}
    monkeypatch.setattr(render_train_command, "train_command", lambda size, config_dir=None: rendered[size])
    text = README.read_text()
    assert render_train_command.readme_section() in text
    for size in render_train_command.SIZES:
        assert f"```bash\n{render_train_command.train_command(size)}\n```" in text


def test_render_train_command_prints_the_command():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "render_train_command.py"), "175b"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == load_script("render_train_command").train_command("175b") + "\n"
    assert result.stdout.startswith('fairseq-train "$DATA" \\\n    --task language_modeling --tokens-per-sample 2048')
