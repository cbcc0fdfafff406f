"""Optimizers, chosen with --optimizer and built as plain `torch.optim.Optimizer` objects.

Kept free of heavy imports: the optimizer registry imports every module of this package to find
the built-in optimizers, and `import fairseq` should stay cheap.
"""

import inspect
import math
from typing import Iterable

from fairseq.registry import OPTIMIZER_REGISTRY, register_optimizer  # noqa: F401 (re-exported)
from fairseq.registry import config_name
from fairseq.suggest import did_you_mean


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


# What a few common parameter-group options take, for the error message (others: "a value like <current>").
_ALLOWED = {
    "eps": "a number >= 0, e.g. 1e-08",
    "weight_decay": "a number >= 0, e.g. 0.01",
    "betas": "a pair of numbers in [0, 1), e.g. (0.9, 0.98)",
    "momentum": "a number >= 0, e.g. 0.99",
}


def check_optimizer_overrides(optimizer_cfg, optimization_cfg, overrides: dict) -> None:
    """--optimizer-overrides through the optimizer's own checks, before any training: the optimizer --optimizer
    builds is built over a throwaway parameter; each key must be one of its parameter-group options, and each
    value must pass the torch optimizer's constructor and one step. Raises ValueError naming key, value and
    what is allowed."""
    if not overrides:
        return
    import torch  # deferred: startup (here: this package stays cheap to import)

    probe = torch.zeros(2, requires_grad=True)
    optimizer = build_optimizer(optimizer_cfg, [probe], optimization_cfg)
    current = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    kind = f"--optimizer {component_name(optimizer_cfg, OPTIMIZER_REGISTRY)} ({type(optimizer).__name__})"
    for key, value in overrides.items():
        if key not in current:
            raise ValueError(
                f"--optimizer-overrides {key!r}: not an option of {kind}"
                + did_you_mean(key, current)
                + f"; its options are {', '.join(sorted(current))}"
            )
        if not _all_finite(value):  # inf/nan: the optimizer accepts some (weight_decay, eps), training does not
            raise ValueError(
                f"--optimizer-overrides {{{key!r}: {value!r}}}: not a finite number; {key} takes "
                + _ALLOWED.get(key, f"a finite value like its current {current[key]!r}")
            )
        try:
            _try_override(optimizer, probe, current, key, value)
        except Exception as err:  # any refusal of the optimizer's own code is the user's value
            allowed = _ALLOWED.get(key, f"a value like its current {current[key]!r}")
            raise ValueError(
                f"--optimizer-overrides {{{key!r}: {value!r}}} is refused by {kind} "
                f"({type(err).__name__}: {err}); {key} takes {allowed}"
            ) from None


def _try_override(optimizer, probe, current: dict, key: str, value) -> None:
    # The constructor's checks (when the key is one of its arguments), then one step with the value in place,
    # from parameters of 1 (a step must leave them finite).
    import torch  # deferred: startup (this package stays cheap to import)

    accepted = inspect.signature(type(optimizer)).parameters
    if key in accepted:
        type(optimizer)([probe], **{k: v for k, v in {**current, key: value}.items() if k in accepted})
    optimizer.param_groups[0][key] = value
    with torch.no_grad():
        probe.fill_(1.0)
    probe.grad = probe.detach().clone().fill_(1.0)
    optimizer.step()
    optimizer.param_groups[0][key] = current[key]
    if not bool(torch.isfinite(probe).all()):  # e.g. a weight decay so large that one step overflows
        raise ValueError(f"one step with it makes the parameters {probe.tolist()}")


def _all_finite(value) -> bool:
    """Whether every number in an override value (a number, or a tuple/list of them) is finite."""
    if isinstance(value, (tuple, list)):
        return all(_all_finite(v) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return math.isfinite(value)
    return True


def component_name(cfg, registry) -> str:
    """Registered name of a component config: its `_name`, else the entry whose dataclass it is."""
    if cfg is None:
        raise ValueError(f"no {registry.kind} chosen; pass {registry.flag} NAME ({', '.join(registry.choices())})")
    name = config_name(cfg)
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
