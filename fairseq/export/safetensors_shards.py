"""Write a state dict as Hugging Face's safetensors layout, one shard at a time.

One file `model.safetensors` when everything fits in `max_shard_bytes`, else `model-0000K-of-0000N.safetensors`
plus `model.safetensors.index.json` (`{"metadata": {"total_size": BYTES}, "weight_map": {name: file}}`), the
layout `transformers`' `from_pretrained` reads. Tensors are produced lazily, per shard: besides the source
state dict, the writer holds at most one shard of converted tensors (safetensors writes them from their
memory, without a serialized copy).
"""

import json
import os
import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


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


def plan_shards(specs: Sequence[TensorSpec], dtype: Optional[torch.dtype], max_shard_bytes: int
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


def write_shards(out_dir: str, specs: Sequence[TensorSpec], dtype: Optional[torch.dtype], max_shard_bytes: int
                 ) -> List[str]:
    """Write `specs` (cast to `dtype` when given) under `out_dir`; the names of the files written."""
    from safetensors.torch import save_file

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
