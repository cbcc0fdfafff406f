"""Learning-rate schedulers, chosen with --lr-scheduler.

Kept free of heavy imports: the scheduler registry imports every module of this package to find
the built-in schedulers.
"""

from fairseq.optim.lr_scheduler.fairseq_lr_scheduler import FairseqLRScheduler  # noqa: F401 (re-exported)
from fairseq.registry import LR_SCHEDULER_REGISTRY, register_lr_scheduler  # noqa: F401 (re-exported)
from fairseq.optim import component_name


def build_lr_scheduler(cfg, optimizer, optimization_cfg):
    """Build the scheduler named by `cfg._name` (--lr-scheduler) for a torch optimizer.

    `optimization_cfg` (OptimizationConfig) supplies --lr (the list of learning rates) and --max-update,
    which upstream's scheduler configs read by interpolation. As upstream's trainer does right after
    building, the learning rate of update 0 is set on the optimizer before returning.
    """
    name = component_name(cfg, LR_SCHEDULER_REGISTRY)
    scheduler_cls = LR_SCHEDULER_REGISTRY.get(name)
    lrs = optimization_cfg.lr
    lrs = [float(lrs)] if isinstance(lrs, (int, float)) else [float(x) for x in lrs]
    if not lrs:
        raise ValueError("--lr is empty; pass a learning rate, e.g. --lr 0.0005")
    scheduler = scheduler_cls(cfg, optimizer, lrs, int(optimization_cfg.max_update))
    scheduler.step_update(0)
    return scheduler
