"""Per-step logging outputs summed where they live, turned into Python numbers once per log interval.

A criterion's logging output holds device tensors (`loss`, `nll_loss`) and host ints (`ntokens`).
Calling `.item()` on a tensor waits for the GPU; doing that every step stalls the CPU that should be
queueing the next step's kernels. `LoggingOutputSums.add` only launches additions on the device;
`reduce` moves everything to the host in one transfer (after at most one all-reduce across ranks), and
its result is what the criterion's `reduce_metrics([...])` is given at the log boundary.
"""

from typing import Any, Dict, Mapping, Optional

import torch
import torch.distributed as dist


class LoggingOutputSums:
    """Running sums of scalar logging-output values, per key, in the order keys first appeared."""

    def __init__(self):
        self._sums: Dict[str, Any] = {}
        self._integral: Dict[str, bool] = {}
        self.num_steps = 0

    def __len__(self) -> int:
        return len(self._sums)

    def __contains__(self, key: str) -> bool:
        return key in self._sums

    def add(self, logging_output: Mapping[str, Any]) -> None:
        """Add one step's values: scalar tensors stay on their device, Python numbers stay on the host."""
        for key, value in logging_output.items():
            if torch.is_tensor(value):
                if value.numel() != 1:
                    raise ValueError(f"logging output {key!r} has {value.numel()} elements; only scalars are summed")
                integral = not (value.is_floating_point() or value.is_complex())
                # float64 keeps sums of many fp32/bf16 steps exact enough; no host round trip is involved
                value = value.detach().reshape(()).to(torch.int64 if integral else torch.float64)
            elif isinstance(value, (bool, int, float)):
                integral = not isinstance(value, float)
            else:
                raise TypeError(f"logging output {key!r} is a {type(value).__name__}, not a number or tensor")
            if key in self._sums:
                self._sums[key] = self._sums[key] + value
                self._integral[key] = self._integral[key] and integral
            else:
                self._sums[key] = value
                self._integral[key] = integral
        self.num_steps += 1

    def reduce(
        self, group: Optional[dist.ProcessGroup] = None, all_reduce: bool = False, device: Optional[torch.device] = None
    ) -> Dict[str, Any]:
        """Return {key: sum} as Python numbers (ints where every value was integral) and start over.

        One host transfer for all keys. With `all_reduce=True` (and torch.distributed initialized) the
        sums are first added across the ranks of `group` in one all-reduce; every rank must then have
        logged the same keys. `device` is where that all-reduce runs when no value is a tensor (NCCL needs
        a CUDA device); otherwise the first tensor's device is used.
        """
        keys = list(self._sums)
        sums = self._sums
        integral = self._integral
        self._sums, self._integral, self.num_steps = {}, {}, 0
        reduce_across_ranks = all_reduce and dist.is_available() and dist.is_initialized()
        tensors = [v for v in sums.values() if torch.is_tensor(v)]
        if not keys or (not tensors and not reduce_across_ranks):
            values = [sums[k] for k in keys]
        else:
            target = tensors[0].device if tensors else (device or torch.device("cpu"))
            # device sums first, host numbers after: one stack, one small copy, one transfer back
            tensor_keys = [k for k in keys if torch.is_tensor(sums[k])]
            number_keys = [k for k in keys if not torch.is_tensor(sums[k])]
            parts = []
            if tensor_keys:
                parts.append(torch.stack([sums[k].to(target, torch.float64) for k in tensor_keys]))
            if number_keys:
                parts.append(torch.tensor([float(sums[k]) for k in number_keys], dtype=torch.float64).to(target))
            packed = torch.cat(parts)
            if reduce_across_ranks:
                dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
            by_key = dict(zip(tensor_keys + number_keys, packed.tolist()))
            values = [by_key[k] for k in keys]
        return {k: (int(round(v)) if integral[k] else float(v)) for k, v in zip(keys, values)}
