#!/usr/bin/env python3
"""Render the SLURM batch script for a large-LM recipe and submit it (or print it with --dry-run).

    python scripts/slurm_submit.py 175b --nodes 128 --gpus-per-node 8 --data /data/gpt2-bin \
        --save-dir /checkpoints/opt-175b --partition learn --time 72:00:00 [hydra overrides ...]

The script is examples/large_lm/slurm/train.sbatch.in with the values filled in: one task per GPU under
srun, logs in the save dir, requeue after preemption. Before writing anything the recipe is composed with
the overrides and checked, so a typo fails here rather than after the job waited in the queue.

The recipes fix the global batch (tokens per update): on a GPU count other than the one a recipe was
written for, optimization.update_freq is set so that batch_size x update_freq x GPUs stays the recipe's
(pass optimization.update_freq=[N] yourself to choose otherwise).

--model-parallel-size N adds tensor parallelism inside each node (distributed_training.model_parallel_size=N,
docs/parallelism.md): N must divide --gpus-per-node, and the global batch is then counted over the
GPUs / N data-parallel ranks, whose batch_size sequences each TP group shares.

Without --dry-run the script is written to SAVE_DIR/JOB_NAME.sbatch and submitted with `sbatch`. (submitit
is not used: it submits through sbatch as well, and its own USR2-based requeue would bypass the trainer's
USR1 -> checkpoint_last -> scontrol requeue path.)
"""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "examples" / "large_lm" / "config"
TEMPLATE = REPO / "examples" / "large_lm" / "slurm" / "train.sbatch.in"
STATIC_SBATCH = REPO / "examples" / "large_lm" / "slurm" / "train.sbatch"
PLACEHOLDER = re.compile(r"@([A-Z_]+)@")

# What train.sbatch is rendered with. Values are shell words: there the parameters come from the
# environment, with defaults; a script rendered for a submission has them written in (an exported SIZE or
# DATA in the submitting shell must not change what was asked for).
STATIC_VALUES = {
    "JOB_NAME": "lm-125m",
    "NODES": "1",
    "GPUS_PER_NODE": "8",
    "CPUS_PER_TASK": "8",
    "TIME": "48:00:00",
    "LOG_DIR": "checkpoints/125m",
    "SIZE": "${SIZE:-125m}",
    "DATA": "${DATA:-}",
    "SAVE_DIR": "${SAVE_DIR:-checkpoints/$SIZE}",
    "CONFIG_DIR": '${CONFIG_DIR:-"$SLURM_SUBMIT_DIR"/examples/large_lm/config}',
    "OVERRIDES": "",
    "EXTRA_SBATCH_LINES": "",
}


def render_template(values: dict, template: Path = TEMPLATE) -> str:
    """Fill every @NAME@ of the template; an empty EXTRA_SBATCH_LINES line disappears."""
    text = template.read_text()
    names = set(PLACEHOLDER.findall(text))
    missing = sorted(names - set(values))
    if missing:
        raise ValueError(f"{template}: no value for {', '.join('@' + m + '@' for m in missing)}")
    if not values.get("EXTRA_SBATCH_LINES"):
        text = text.replace("@EXTRA_SBATCH_LINES@\n", "")
    return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), text)


def render_static() -> str:
    """examples/large_lm/slurm/train.sbatch: the template with its defaults (a test keeps the file equal)."""
    return render_template(STATIC_VALUES)


def _override_value(overrides, key):
    for item in overrides:
        name, _, value = item.lstrip("+").partition("=")
        if name == key:
            return value
    return None


DATA_FROM_ENVIRONMENT = '${DATA:?"set DATA to the data directory (or render the script with --data DIR)"}'


def plan_overrides(
    size: str,
    nodes: int,
    gpus_per_node: int,
    data,
    overrides,
    config_dir: Path = CONFIG_DIR,
    model_parallel_size: int = 1,
):
    """(overrides to write into the script, whether the task needs DATA from the environment, notes).

    Adds optimization.update_freq when the data-parallel rank count changes the global batch, and the
    model-parallel size. Composes and checks the whole config first; raises ValueError with the fix.
    """
    if model_parallel_size < 1 or gpus_per_node % model_parallel_size:
        raise ValueError(
            f"--model-parallel-size {model_parallel_size} must divide --gpus-per-node {gpus_per_node}: "
            "tensor parallelism stays inside a node"
        )
    if model_parallel_size > 1:
        overrides = [f"distributed_training.model_parallel_size={model_parallel_size}"] + list(overrides)
    from fairseq.frontend.hydra import MISSING, compose_dict, fairseq_config_from_dict, recipe_update_freq, split_recipe

    overrides, notes = list(overrides), []
    probe = overrides + ["checkpoint.save_dir=/probe", "distributed_training.distributed_port=1"]
    values, recipe = split_recipe(compose_dict(str(config_dir), size, probe))
    task = dict(values.get("task") or {})
    needs_data = task.get("data") == MISSING and task.get("_name", "language_modeling") in (
        "language_modeling",
        "streaming_language_modeling",
    )
    data_from_env = needs_data and data is None
    if data_from_env:
        notes.append("no --data: the job reads the data directory from $DATA when it starts")
    if data is not None or data_from_env:
        task["data"] = str(data) if data is not None else "/data/from/environment"
    cfg = fairseq_config_from_dict(dict(values, task=task))
    from fairseq.distributed.mesh import ParallelLayout
    from fairseq.distributed.tensor_parallel_checks import (
        check_tensor_parallel_config,
        check_tensor_parallel_dictionary,
    )

    check_tensor_parallel_config(cfg.distributed_training.model_parallel_size, cfg.model)
    check_tensor_parallel_dictionary(cfg)  # when --data is readable here
    world = ParallelLayout.from_config(cfg.distributed_training, nodes * gpus_per_node).dp  # data-parallel ranks
    if _override_value(overrides, "optimization.update_freq") is None and cfg.dataset.batch_size and recipe:
        wanted = recipe_update_freq(recipe, cfg.dataset.batch_size, cfg.task.tokens_per_sample, world)
        if [wanted] != cfg.optimization.update_freq:
            overrides = [f"optimization.update_freq=[{wanted}]"] + overrides
            ranks = f"{world} data-parallel ranks" if model_parallel_size > 1 else f"{world} GPUs"
            notes.append(
                f"{ranks} instead of the recipe's {recipe.get('gpus')} GPUs: optimization.update_freq="
                f"[{wanted}] keeps the global batch at {recipe['global_batch_tokens']:,} tokens"
            )
    return overrides, data_from_env, notes


def render_sbatch(args, overrides, data_from_env: bool = False) -> str:
    save_dir = Path(args.save_dir).expanduser().resolve()
    if re.search(r"\s", str(save_dir)):
        raise ValueError(f"--save-dir {save_dir}: #SBATCH --output cannot name a path with spaces; choose another")
    extra = []
    for name in ("partition", "account", "qos", "constraint"):
        if getattr(args, name):
            extra.append(f"#SBATCH --{name}={getattr(args, name)}")
    extra += [f"#SBATCH {option}" for option in args.sbatch_option]
    values = {
        "JOB_NAME": args.job_name or f"lm-{args.size}",
        "NODES": args.nodes,
        "GPUS_PER_NODE": args.gpus_per_node,
        "CPUS_PER_TASK": args.cpus_per_task,
        "TIME": args.time,
        "LOG_DIR": save_dir,
        "SIZE": shlex.quote(args.size),
        "DATA": (
            DATA_FROM_ENVIRONMENT
            if data_from_env
            else shlex.quote(str(Path(args.data).expanduser().resolve()) if args.data else "")
        ),
        "SAVE_DIR": shlex.quote(str(save_dir)),
        "CONFIG_DIR": shlex.quote(str(Path(args.config_dir).resolve())),
        "OVERRIDES": " ".join(shlex.quote(o) for o in overrides),
        "EXTRA_SBATCH_LINES": "\n".join(extra),
    }
    return render_template(values)


def submit(script_path: Path) -> int:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ValueError(
            "sbatch is not on PATH: run this on a SLURM login node, or pass --dry-run to print the "
            f"script (it was written to {script_path})"
        )
    result = subprocess.run([sbatch, str(script_path)], capture_output=True, text=True)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if result.returncode != 0:
        raise ValueError(f"sbatch {script_path} failed with status {result.returncode}")
    match = re.search(r"Submitted batch job (\d+)", result.stdout)
    if match:
        print(f"logs: {script_path.parent}/{script_path.stem}-{match.group(1)}.out (.err)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    sizes = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("size", help=f"recipe in --config-dir ({', '.join(sizes)})")
    parser.add_argument("--nodes", type=int, required=True, help="number of nodes")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node (one task each)")
    parser.add_argument("--data", help="preprocessed data directory (not needed with task._name=dummy_lm)")
    parser.add_argument("--save-dir", help="checkpoints, logs and the script (default: checkpoints/SIZE)")
    parser.add_argument("--partition", help="SLURM partition")
    parser.add_argument("--account", help="SLURM account")
    parser.add_argument("--qos", help="SLURM quality of service")
    parser.add_argument("--constraint", help="SLURM node features, e.g. a100")
    parser.add_argument(
        "--time", default="48:00:00", help="time limit per run; requeued runs continue (default: %(default)s)"
    )
    parser.add_argument("--cpus-per-task", type=int, default=8, help="CPUs per GPU task (default: %(default)s)")
    parser.add_argument(
        "--model-parallel-size",
        type=int,
        default=1,
        help="tensor parallelism over this many GPUs of a node (default: %(default)s)",
    )
    parser.add_argument("--job-name", help="SLURM job name (default: lm-SIZE)")
    parser.add_argument(
        "--sbatch-option",
        action="append",
        default=[],
        metavar="OPTION",
        help="another #SBATCH line, e.g. --sbatch-option=--exclusive (repeatable)",
    )
    parser.add_argument("--config-dir", default=str(CONFIG_DIR), help="directory of the recipes")
    parser.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for the recipe, e.g. optimization.lr=[1e-4]")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after the options
    if not (Path(args.config_dir) / f"{args.size}.yaml").is_file():
        parser.error(f"no recipe {args.size!r}: {args.config_dir}/{args.size}.yaml does not exist")
    if args.nodes < 1 or args.gpus_per_node < 1:
        parser.error(f"--nodes {args.nodes} and --gpus-per-node {args.gpus_per_node} must be at least 1")
    args.save_dir = args.save_dir or os.path.join("checkpoints", args.size)
    try:
        overrides, data_from_env, notes = plan_overrides(
            args.size,
            args.nodes,
            args.gpus_per_node,
            args.data,
            args.overrides,
            Path(args.config_dir),
            model_parallel_size=args.model_parallel_size,
        )
        script = render_sbatch(args, overrides, data_from_env)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        if args.dry_run:
            sys.stdout.write(script)
            return 0
        save_dir = Path(args.save_dir).expanduser().resolve()
        save_dir.mkdir(parents=True, exist_ok=True)  # SLURM opens the log files there and does not create it
        script_path = save_dir / f"{args.job_name or 'lm-' + args.size}.sbatch"
        script_path.write_text(script)
        print(f"wrote {script_path}")
        return submit(script_path)
    except ValueError as err:
        print(f"slurm_submit.py: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
