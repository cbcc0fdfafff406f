#!/usr/bin/env python3
"""Average the weights of several checkpoints into one (upstream's script and flags).

    python scripts/average_checkpoints.py --inputs checkpoints --num-update-checkpoints 5 --output avg.pt
    python scripts/average_checkpoints.py --inputs a.pt b.pt c.pt --output avg.pt

The output is the first checkpoint with its "model" replaced by the element-wise mean of all inputs' models
(integer tensors: the floor of the mean; fp16/bf16 weights are averaged and written in fp32, as upstream).
Inputs may be single files or sharded checkpoint directories (--use-sharded-state; written out as one file).
Checkpoints are read without unpickling code; upstream fairseq files need --trust-legacy-checkpoint.
The inputs must be checkpoints of one model: the same parameter names and shapes, the same dictionary (the
fingerprint each stores) and the same options that define the function computed (what resume compares); the
--output may not be one of them.
"""

import argparse
import collections
import os
import re
import sys
from typing import Dict, List, Optional

import torch

from fairseq.checkpoint.fit import architecture_options, differing_option
from fairseq.checkpoint.inference import read_checkpoint_state
from fairseq.checkpoint.io import atomic_torch_save, load_checkpoint_file
from fairseq.checkpoint.vocabulary import carried
from fairseq_cli.console import run_console_script


def _read(path: str, trust_legacy: bool) -> Dict:
    if os.path.isdir(path):  # a sharded checkpoint: its full tensors, upstream's layout
        return read_checkpoint_state(path, trust_legacy=trust_legacy)
    return load_checkpoint_file(path, trust_legacy=trust_legacy)  # as saved (an upstream file keeps its layout)


def average_checkpoints(inputs: List[str], trust_legacy_checkpoint: bool = False) -> Dict:
    """The first checkpoint's state with "model" the average of the inputs' (an OrderedDict of tensors)."""
    if not inputs:
        raise ValueError("average_checkpoints needs at least one checkpoint")
    sums: "collections.OrderedDict[str, torch.Tensor]" = collections.OrderedDict()
    keys, first = None, None
    for path in inputs:
        state = _read(path, trust_legacy_checkpoint)
        if "model" not in state:
            raise ValueError(f"{path} has no 'model' entry: not a fairseq checkpoint")
        first = state if first is None else first
        model = state["model"]
        if keys is None:
            keys = list(model.keys())
        else:
            _check_same_parameters(inputs[0], sums, path, model)
            _check_same_model(inputs[0], first, path, state)
        for key in keys:
            p = model[key]
            if p.dtype in (torch.float16, torch.bfloat16):
                p = p.float()
            if key in sums:
                sums[key] += p
            else:
                sums[key] = p.clone()  # a copy: tied weights share storage and must be summed apart
    for key, total in sums.items():
        if total.is_floating_point():
            total.div_(len(inputs))
        else:
            total //= len(inputs)  # upstream truncates integer averages
    first["model"] = sums
    return first


def _check_same_parameters(first_path: str, first: Dict, path: str, model: Dict) -> None:
    """The same parameter names (in any order) and shapes as the first checkpoint, else one ValueError naming
    both files and the first parameter that differs."""
    differing = sorted(set(first) ^ set(model))
    if differing:
        key = differing[0]
        has, lacks = (first_path, path) if key in first else (path, first_path)
        raise ValueError(
            f"{path} and {first_path} hold different parameters: {has} has {key!r}, {lacks} does not; "
            "average checkpoints of one model only"
        )
    for key, total in first.items():
        if tuple(model[key].shape) != tuple(total.shape):
            raise ValueError(
                f"{path} and {first_path} hold different parameters: {key!r} is "
                f"{list(model[key].shape)} in {path} but {list(total.shape)} in {first_path}; "
                "average checkpoints of one model only"
            )


def _model_config(state: Dict) -> Dict:
    cfg = state.get("cfg")
    model = cfg.get("model") if isinstance(cfg, dict) else None
    return model if isinstance(model, dict) else {}


def _check_same_model(first_path: str, first: Dict, path: str, state: Dict) -> None:
    """The same dictionary (the fingerprint each checkpoint stores) and the same options that define the
    function computed (the model class's `architecture_options`, as resume compares them): parameters of the
    same names and shapes can still mean other words or another network. One ValueError naming both files."""
    ours, theirs = carried(first) or {}, carried(state) or {}
    if (
        ours.get("dictionary_sha256")
        and theirs.get("dictionary_sha256")
        and ours["dictionary_sha256"] != theirs["dictionary_sha256"]
    ):
        raise ValueError(
            f"{path} and {first_path} were trained with different dictionaries (dictionary_sha256 "
            f"{theirs['dictionary_sha256'][:12]}... in {path}, {ours['dictionary_sha256'][:12]}... in "
            f"{first_path}), so the same ids are other words; average checkpoints of one model only"
        )
    saved, other = _model_config(first), _model_config(state)
    name = differing_option(architecture_options(saved.get("_name")), saved, other)
    if name is not None:
        raise ValueError(
            f"{path} and {first_path} are different models: --{name.replace('_', '-')} is "
            f"{other[name]!r} in {path} but {saved[name]!r} in {first_path}; average checkpoints of one "
            "model only"
        )


def last_n_checkpoints(paths: List[str], n: int, update_based: bool, upper_bound: Optional[int] = None) -> List[str]:
    """The `n` newest epoch (checkpointN) or update (checkpoint_E_U) checkpoints in the one directory of
    `paths`, up to `upper_bound` (epoch or update)."""
    if len(paths) != 1:
        raise ValueError("--num-epoch-checkpoints / --num-update-checkpoints take one directory as --inputs")
    directory = paths[0]
    pattern = re.compile(r"checkpoint_\d+_(\d+)(\.pt)?" if update_based else r"checkpoint(\d+)(\.pt)?")
    entries = []
    for name in os.listdir(directory):
        match = pattern.fullmatch(name)
        if match is not None:
            key = int(match.group(1))
            if upper_bound is None or key <= upper_bound:
                entries.append((key, name))
    if len(entries) < n:
        raise ValueError(
            f"found {len(entries)} {'update' if update_based else 'epoch'} checkpoints in {directory} "
            f"but --num-{'update' if update_based else 'epoch'}-checkpoints asks for {n}"
        )
    return [os.path.join(directory, name) for _, name in sorted(entries, reverse=True)[:n]]


def best_n_checkpoints(paths: List[str], n: int) -> List[str]:
    """The `n` best of --keep-best-checkpoints' files (checkpoint.best_METRIC_VALUE.pt), lowest value first."""

    def value(path: str) -> float:
        name = os.path.basename(path.rstrip(os.sep))
        try:
            return float(name.split("_")[-1].replace(".pt", ""))
        except ValueError:
            raise ValueError(f"--num-best-checkpoints: {path} is not named checkpoint.best_METRIC_VALUE.pt") from None

    return sorted(paths, key=value)[:n]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="average the weights of checkpoints into a new checkpoint")
    parser.add_argument(
        "--inputs",
        required=True,
        nargs="+",
        help="checkpoint files, or the directory of them with --num-epoch-checkpoints / --num-update-checkpoints",
    )
    parser.add_argument("--output", required=True, metavar="FILE", help="where to write the averaged checkpoint")
    count = parser.add_mutually_exclusive_group()
    count.add_argument(
        "--num-epoch-checkpoints",
        type=int,
        help="average the last N epoch checkpoints (checkpointN.pt) in the --inputs directory",
    )
    count.add_argument(
        "--num-update-checkpoints",
        type=int,
        help="average the last N update checkpoints (checkpoint_E_U.pt) in the --inputs directory",
    )
    count.add_argument(
        "--num-best-checkpoints",
        type=int,
        default=0,
        help="average the N best of the --inputs files named checkpoint.best_METRIC_VALUE.pt (lowest value first)",
    )
    parser.add_argument(
        "--checkpoint-upper-bound",
        type=int,
        help="with --num-epoch-checkpoints or --num-update-checkpoints: the last epoch or update to "
        "use, e.g. --num-epoch-checkpoints 10 --checkpoint-upper-bound 50 averages 41..50",
    )
    parser.add_argument(
        "--trust-legacy-checkpoint",
        action="store_true",
        help="allow upstream fairseq checkpoints, which contain pickled Python objects (only for "
        "files you trust: unpickling can run code)",
    )
    args = parser.parse_args(argv)
    if (
        args.checkpoint_upper_bound is not None
        and args.num_epoch_checkpoints is None
        and args.num_update_checkpoints is None
    ):
        parser.error("--checkpoint-upper-bound requires --num-epoch-checkpoints or --num-update-checkpoints")
    inputs = args.inputs
    if args.num_update_checkpoints is not None:
        inputs = last_n_checkpoints(inputs, args.num_update_checkpoints, True, args.checkpoint_upper_bound)
    elif args.num_epoch_checkpoints is not None:
        inputs = last_n_checkpoints(inputs, args.num_epoch_checkpoints, False, args.checkpoint_upper_bound)
    elif args.num_best_checkpoints > 0:
        inputs = best_n_checkpoints(inputs, args.num_best_checkpoints)
    for path in inputs:  # the output replaces its file: never an input (also as another name of the same file)
        if os.path.exists(args.output) and os.path.samefile(args.output, path):
            raise ValueError(
                f"--output {args.output} is the input {path}: writing the average would replace "
                "that checkpoint; choose another --output"
            )
    print(f"averaging checkpoints: {inputs}")
    atomic_torch_save(average_checkpoints(inputs, args.trust_legacy_checkpoint), args.output, flag="--output")
    print(f"Finished writing averaged checkpoint to {args.output}.")


if __name__ == "__main__":
    sys.exit(run_console_script("average_checkpoints", main))
