#!/usr/bin/env python3
"""Measured peak memory of a large-LM recipe on one GPU against the memory planner's prediction for the same config.

    python scripts/validate_memory_plan.py                      # 175b_tp8, 2 layers, the TP plan on a one-rank mesh
    python scripts/validate_memory_plan.py --config-name 66b_tp8 --layers 2
    python scripts/validate_memory_plan.py --dry-run            # the command and the prediction, nothing run
    python scripts/validate_memory_plan.py --log OUT/train.log  # compare a log of an earlier run

Runs `fairseq-hydra-train --config-name RECIPE` on one GPU with synthetic tokens (task dummy_lm, the recipes'
50272-symbol vocabulary), `--layers` decoder layers at the recipe's width, the recipe's batch per data-parallel
rank and every other setting of the recipe (float8, compile, checkpointing, FSDP flags); with
--model-parallel-size 1 and FAIRSEQ_TP_MESH_OF_ONE=1 (unless --no-tp-mesh-of-one) the tensor-parallel plan
applies on a tp dimension of size 1, so the TP code path (its styles, float8 casts and hooks) runs on one GPU.
The prediction is fairseq.planning.plan_memory's for the config fairseq-hydra-train composes from the same
overrides (`inputs_from_config`). Prints predicted and measured peak allocated memory (the log's largest
max_cuda_gb_allocated over every update, Adam's state existing from the first step on) and their difference,
the planner's breakdown at its peak, and reserved memory against the planner's total with margin. Extra hydra
overrides after `--` apply to both.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "examples" / "large_lm" / "config"
DICT_SIZE = 50268  # dummy_lm adds the 4 specials: the recipes' 50272


def overrides(args, out: Path):
    """The hydra overrides of the run; the ones of the config (not hydra's) are also what the planner composes."""
    config = [
        "task._name=dummy_lm",
        f"task.dict_size={DICT_SIZE}",
        f"model.decoder_layers={args.layers}",
        "distributed_training.model_parallel_size=1",
        "distributed_training.distributed_world_size=1",
        f"optimization.max_update={args.updates}",
        "optimization.update_freq=[1]",
        "checkpoint.no_save=true",
        "dataset.disable_validation=true",  # dummy_lm's validation split is 100,000 samples
        "common.log_interval=1",
        "common.log_format=json",
        f"common.log_file={out / 'train.log'}",
        *args.overrides,
    ]
    return config, [f"hydra.run.dir={out / 'run'}"]


def predict(args, config_overrides, env):
    """(plan, gpu memory GiB) of the planner for the composed config, on one GPU, in the run's environment."""
    from fairseq.frontend.hydra import compose_dict, fairseq_config_from_dict, split_recipe
    from fairseq.planning import hardware
    from fairseq.planning.request import inputs_from_config
    from fairseq.planning import memory_model as mm

    values, _ = split_recipe(compose_dict(str(args.config_dir), args.config_name, config_overrides))
    cfg = fairseq_config_from_dict(values)
    shape, setup = inputs_from_config(cfg, gpus=1, vocab_size=DICT_SIZE + 4, environ=env)
    return mm.plan(shape, setup), hardware.GPUS[args.gpu].memory_gib


def measured(log_file: Path):
    """(largest max_cuda_gb_allocated, largest max_cuda_gb_reserved, allocator retries, updates) of a json log."""
    from fairseq.logging.progress_bar import read_json_log

    rows = [r for r in read_json_log(log_file, "train_inner") if "max_cuda_gb_allocated" in r]
    if not rows:
        raise SystemExit(f"{log_file}: no train_inner line with max_cuda_gb_allocated (was it a GPU run?)")
    return (
        max(float(r["max_cuda_gb_allocated"]) for r in rows),
        max(float(r.get("max_cuda_gb_reserved", 0)) for r in rows),
        sum(float(r.get("cuda_alloc_retries", 0)) for r in rows),
        len(rows),
    )


def report(plan, gpu_gib, measurement) -> str:
    from fairseq.planning import memory_model as mm
    from fairseq.planning.plan_memory import render_plan

    lines = [f"planner ({plan.setup.gpus} GPU, tp_plan_on_one_rank={plan.setup.tp_plan_on_one_rank}):"]
    lines += render_plan(plan, gpu_gib)
    predicted = mm.gib(plan.peak_bytes)
    if measurement is None:
        return "\n".join(lines + [f"predicted peak allocated: {predicted:.2f} GiB (not run)"])
    allocated, reserved, retries, updates = measurement
    lines += [
        f"{'':<22}{'predicted':>12}{'measured':>12}{'difference':>12}",
        f"{'peak allocated GiB':<22}{predicted:12.2f}{allocated:12.2f}{(predicted - allocated) / allocated:+12.1%}",
        f"{'with margin / reserved':<22}{mm.gib(plan.required_bytes):12.2f}{reserved:12.2f}"
        f"{(mm.gib(plan.required_bytes) - reserved) / reserved:+12.1%}",
        f"over {updates} logged updates; allocator retries: {retries:g}",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", default="175b_tp8", help="recipe in --config-dir (default: 175b_tp8)")
    parser.add_argument("--config-dir", type=Path, default=CONFIG_DIR)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    parser.add_argument("--updates", type=int, default=6, help="updates to run (default: 6)")
    from fairseq.planning.hardware import GPUS

    parser.add_argument("--gpu", default="h200", choices=sorted(GPUS), help="the GPU, for its memory (default: h200)")
    parser.add_argument("--out", type=Path, default=Path("work/validate_memory_plan"), help="run directory")
    parser.add_argument(
        "--no-tp-mesh-of-one",
        action="store_true",
        help="run without FAIRSEQ_TP_MESH_OF_ONE (the plain FSDP path at model_parallel_size 1)",
    )
    parser.add_argument("--log", type=Path, help="compare this json log of an earlier run instead of running")
    parser.add_argument("--dry-run", action="store_true", help="print the command and the prediction only")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for both, after --")
    args = parser.parse_args(argv)

    out = args.out.resolve()
    config_overrides, hydra_overrides = overrides(args, out)
    from fairseq.distributed.mesh import TP_MESH_OF_ONE

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop(TP_MESH_OF_ONE, None)
    if not args.no_tp_mesh_of_one:
        env[TP_MESH_OF_ONE] = "1"
    plan, gpu_gib = predict(args, config_overrides, env)
    command = [
        sys.executable,
        "-m",
        "fairseq_cli.hydra_train",
        "--config-dir",
        str(args.config_dir),
        "--config-name",
        args.config_name,
        *config_overrides,
        *hydra_overrides,
    ]
    knob = "" if args.no_tp_mesh_of_one else f"{TP_MESH_OF_ONE}=1 "
    print(f"command: {knob}{' '.join(command)}", flush=True)
    if args.dry_run:
        print(report(plan, gpu_gib, None))
        return 0
    log_file = args.log
    if log_file is None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train.log").unlink(missing_ok=True)
        with open(out / "stdout.txt", "w") as sink:
            code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=str(REPO)).returncode
        if code != 0:
            tail = (out / "stdout.txt").read_text()[-3000:]
            print(f"fairseq-hydra-train failed with status {code}; the end of {out / 'stdout.txt'}:\n{tail}")
            return code
        log_file = out / "train.log"
    print(report(plan, gpu_gib, measured(log_file)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
