"""Hugging Face's weight files: a state dict written as safetensors, one shard at a time (the export), and the
weights of a model directory read back (`read_weights`, the import).

One file `model.safetensors` when everything fits in `max_shard_bytes`, else `model-0000K-of-0000N.safetensors`
plus `model.safetensors.index.json` (`{"metadata": {"total_size": BYTES}, "weight_map": {name: file}}`), the
layout `transformers`' `from_pretrained` reads. Tensors are produced lazily, per shard: besides the source
state dict, the writer holds at most one shard of converted tensors (safetensors writes them from their
memory, without a serialized copy).
"""

import json
import os
import pickle
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLE_NAME = "pytorch_model.bin"  # transformers' older format, read with weights_only=True only
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


@dataclass
class TensorSpec:
    """One output tensor: its name, shape and source dtype are known before `make()` computes it."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]


def parse_size(text: str) -> int:
    """Bytes of a size such as "5GB", "500MB", "2GiB" or "1000000" (--max-shard-size)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"--max-shard-size {text!r}: expected a positive size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def plan_shards(
    specs: Sequence[TensorSpec], dtype: Optional[torch.dtype], max_shard_bytes: int
) -> List[List[TensorSpec]]:
    """Consecutive groups of tensors of at most `max_shard_bytes` each (a bigger tensor gets a shard alone)."""
    shards: List[List[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = _nbytes(spec, dtype)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _nbytes(spec: TensorSpec, dtype: Optional[torch.dtype]) -> int:
    numel = 1
    for n in spec.shape:
        numel *= n
    return numel * (dtype or spec.dtype).itemsize


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    # safetensors refuses tensors that share memory with another one (tied weights, views of a bigger buffer).
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def write_shards(
    out_dir: str, specs: Sequence[TensorSpec], dtype: Optional[torch.dtype], max_shard_bytes: int
) -> List[str]:
    """Write `specs` (cast to `dtype` when given) under `out_dir`; the names of the files written."""
    from safetensors.torch import save_file  # deferred: optional (the export extra)

    shards = plan_shards(specs, dtype, max_shard_bytes)
    if len(shards) == 1:
        names = [WEIGHTS_NAME]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    umask = os.umask(0)
    os.umask(umask)
    for name, shard in zip(names, shards):
        tensors = {}
        for spec in shard:
            tensor = spec.make()
            if tuple(tensor.shape) != tuple(spec.shape):  # the plan was made from the shapes: keep them honest
                raise RuntimeError(f"{spec.name}: planned shape {spec.shape}, made {tuple(tensor.shape)}")
            tensors[spec.name] = _own_storage(tensor.to(dtype) if dtype is not None else tensor)
            weight_map[spec.name] = name
        path = os.path.join(out_dir, name)
        try:
            save_file(tensors, path, metadata={"format": "pt"})
        except Exception as err:  # safetensors' Rust writer reports a failed write as "... (os error N)"
            found = re.search(r"os error (\d+)", str(err))
            if found is None:
                raise
            code = int(found.group(1))
            raise OSError(code, os.strerror(code), path) from None
        os.chmod(os.path.join(out_dir, name), 0o666 & ~umask)  # safetensors creates its files private
        del tensors
    if len(shards) > 1:
        total = sum(_nbytes(spec, dtype) for spec in specs)
        with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
            f.write("\n")
        names.append(INDEX_NAME)
    return names


# ------------------------------------------------------------------------------------------------ reading


def read_weights(directory: str) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """(name -> tensor, the files read) of a transformers model directory: model.safetensors or its shards
    (model.safetensors.index.json), else pytorch_model.bin or its shards, loaded with weights_only=True (a file
    that needs more is refused). The tensors keep their stored dtype."""
    for index_name, single_name in ((INDEX_NAME, WEIGHTS_NAME), (PICKLE_INDEX_NAME, PICKLE_NAME)):
        index = os.path.join(directory, index_name)
        if os.path.isfile(index):
            files = _indexed_files(index)
        elif os.path.isfile(os.path.join(directory, single_name)):
            files = [single_name]
        else:
            continue
        state: Dict[str, torch.Tensor] = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{index} names {name}, which is not in {directory}; copy every weight file "
                    "of the model into the directory"
                )
            state.update(_read_safetensors(path) if name.endswith(".safetensors") else _read_pickle(path))
        return state, files
    raise FileNotFoundError(
        f"{directory} holds no weights (looked for {WEIGHTS_NAME}, {INDEX_NAME}, {PICKLE_NAME}, "
        f"{PICKLE_INDEX_NAME}); pass the directory transformers' save_pretrained wrote"
    )


def _indexed_files(index: str) -> List[str]:
    """The files `index` names, each a path inside its directory (an absolute path or one through .. is refused:
    the import reads the model's directory only)."""
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{index} is not a weight index ({type(e).__name__}: {e}); expected "
            '{"weight_map": {tensor name: file name}} as transformers writes it'
        ) from None
    for name in names:
        if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
            raise ValueError(
                f"{index} names the weight file {json.dumps(name)}, outside {os.path.dirname(index)}; an "
                "index names files of its own directory: copy the model's files into one directory"
            )
    return names


def _read_safetensors(path: str) -> Dict[str, torch.Tensor]:
    from safetensors import SafetensorError  # deferred: optional (the export extra)
    from safetensors.torch import load_file  # deferred: optional (the export extra)

    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e}); copy it again") from None


def _read_pickle(path: str) -> Dict[str, torch.Tensor]:
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:  # a file from before torch 1.6's zip format cannot be memory-mapped
            if "mmap" not in str(e):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{path} holds pickled Python objects besides tensors, which are not loaded (they can run "
            f"code); save the model as safetensors with transformers first ({str(e).splitlines()[0]})"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(
            f"{path} is not a readable PyTorch weights file ({type(e).__name__}: {e}); copy it again"
        ) from None
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ValueError(f"{path} is not a state dict of tensors; pass a transformers model directory")
    return state
