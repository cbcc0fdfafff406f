"""The order in which FSDP2 gathers the decoder's layers: which layers each unit all-gathers ahead of itself in
forward and in backward, by FSDP2's own rule or by --fsdp-forward-prefetch's explicit lists. fairseq.distributed.fsdp
hands an explicit plan to FSDP2; the --fsdp-sync-free hooks follow the plan FSDP2 runs."""

from dataclasses import dataclass
from typing import Sequence, Tuple

import torch.nn as nn

# FSDP2's own backward prefetch (no explicit list): the unit that finished forward just before this one.
IMPLICIT_BACKWARD_PREFETCH = 1


@dataclass(frozen=True)
class PrefetchPlan:
    """Which decoder layers each FSDP unit all-gathers, besides its own parameters, when it starts its
    forward or its backward. Layers are indices into model.transformer_layers(); the root is the whole model."""

    root_forward: Tuple[int, ...]
    root_backward: Tuple[int, ...]
    layer_forward: Tuple[Tuple[int, ...], ...]
    layer_backward: Tuple[Tuple[int, ...], ...]


def prefetch_plan(num_layers: int, depth: int, explicit: bool) -> PrefetchPlan:
    """explicit=False describes what FSDP2 does by itself (nothing ahead in forward; in backward each unit
    prefetches the one that ran before it in forward). explicit=True is --fsdp-forward-prefetch: the next
    `depth` layers in forward and the previous `depth` layers in backward, nearest first."""
    if not explicit:
        return PrefetchPlan(
            root_forward=(),
            root_backward=(num_layers - 1,) if num_layers else (),
            layer_forward=tuple(() for _ in range(num_layers)),
            layer_backward=tuple((i - 1,) if i > 0 else () for i in range(num_layers)),
        )
    return PrefetchPlan(
        root_forward=tuple(range(min(depth, num_layers))),
        root_backward=tuple(range(num_layers - 1, max(num_layers - 1 - depth, -1), -1)),
        layer_forward=tuple(tuple(range(i + 1, min(i + 1 + depth, num_layers))) for i in range(num_layers)),
        layer_backward=tuple(tuple(range(i - 1, max(i - 1 - depth, -1), -1)) for i in range(num_layers)),
    )


def apply_prefetch_plan(root: nn.Module, layers: Sequence[nn.Module], plan: PrefetchPlan) -> None:
    """Hand an explicit plan to FSDP2. An empty backward list leaves FSDP2's own choice in place, which for
    the first layer is nothing (no unit ran before it)."""
    root.set_modules_to_forward_prefetch([layers[j] for j in plan.root_forward])
    root.set_modules_to_backward_prefetch([layers[j] for j in plan.root_backward])
    for layer, forward, backward in zip(layers, plan.layer_forward, plan.layer_backward):
        layer.set_modules_to_forward_prefetch([layers[j] for j in forward])
        layer.set_modules_to_backward_prefetch([layers[j] for j in backward])
