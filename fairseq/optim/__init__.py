"""Optimizers, chosen with --optimizer and built as plain `torch.optim.Optimizer` objects.

Kept free of heavy imports: the optimizer registry imports every module of this package to find
the built-in optimizers, and `import fairseq` should stay cheap.
"""

from typing import Iterable

from fairseq.registry import OPTIMIZER_REGISTRY, register_optimizer  # noqa: F401 (re-exported)


def first_lr(optimization_cfg) -> float:
    """The learning rate from --lr: upstream keeps a list (one per epoch for `fixed`); the first is used."""
    lr = optimization_cfg.lr
    if isinstance(lr, (int, float)):
        return float(lr)
    if len(lr) == 0:
        raise ValueError("--lr is empty; pass a learning rate, e.g. --lr 0.0005")
    return float(lr[0])


def build_optimizer(optimizer_cfg, params: Iterable, optimization_cfg):
    """Build the optimizer named by `optimizer_cfg._name` (--optimizer) over `params`.

    `optimization_cfg` is the optimization group (OptimizationConfig); the initial learning rate is its
    first --lr value. Returns a torch.optim.Optimizer.
    """
    name = component_name(optimizer_cfg, OPTIMIZER_REGISTRY)
    optimizer_cls = OPTIMIZER_REGISTRY.get(name)
    return optimizer_cls.build_optimizer(optimizer_cfg, params, first_lr(optimization_cfg))


def component_name(cfg, registry) -> str:
    """Registered name of a component config: its `_name`, else the entry whose dataclass it is."""
    if cfg is None:
        raise ValueError(f"no {registry.kind} chosen; pass {registry.flag} NAME ({', '.join(registry.choices())})")
    name = getattr(cfg, "_name", None)
    if name is not None:
        return name
    matches = [n for n in registry.choices() if registry.dataclass(n) is type(cfg)]
    if len(matches) != 1:
        raise ValueError(
            f"cannot tell which {registry.kind} the config {type(cfg).__name__} belongs to; "
            f"set its _name to one of: {', '.join(registry.choices())}"
        )
    return matches[0]


def get_lr(optimizer) -> float:
    """Learning rate of the first parameter group (all groups share it here)."""
    lr = optimizer.param_groups[0]["lr"]
    return float(lr)


def set_lr(optimizer, lr: float):
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        if hasattr(group["lr"], "fill_"):  # a tensor lr (capturable/compiled steps) is updated in place
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
