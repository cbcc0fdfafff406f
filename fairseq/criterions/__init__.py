"""Training criterions (losses), chosen with --criterion.

Kept free of heavy imports: the criterion registry imports every module of this package to find
the built-in criterions.
"""

import logging

from fairseq.registry import CRITERION_REGISTRY, register_criterion  # noqa: F401 (re-exported)
from fairseq.optim import component_name


def build_criterion(cfg, task, optimization_cfg=None):
    """Build the criterion named by `cfg._name` (--criterion) for `task`.

    `optimization_cfg` (OptimizationConfig) supplies --sentence-avg, which upstream's criterion configs
    read by interpolation (without it, the criterion config's own copy is used). A criterion class
    provides `build_criterion(cfg, task, optimization_cfg=None)`.
    """
    name = component_name(cfg, CRITERION_REGISTRY)
    criterion_cls = CRITERION_REGISTRY.get(name)
    summable = getattr(criterion_cls, "logging_outputs_can_be_summed", None)
    if summable is None or not summable():
        # Upstream's default is False, and most plug-ins never override it although their reduce_metrics
        # only sums; so a warning, not an error.
        logging.getLogger(__name__).warning(
            f"--criterion {name} does not declare logging_outputs_can_be_summed() True; the trainer sums the "
            "logging outputs of each log interval (across micro-batches and ranks) and passes reduce_metrics one "
            "summed output, which is right only if reduce_metrics sums them itself"
        )
    return criterion_cls.build_criterion(cfg, task, optimization_cfg)


def __getattr__(name):
    # Upstream's `from fairseq.criterions import FairseqCriterion`, without importing torch here.
    if name in ("FairseqCriterion", "LegacyFairseqCriterion"):
        from fairseq.criterions import fairseq_criterion  # deferred: startup

        return getattr(fairseq_criterion, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
