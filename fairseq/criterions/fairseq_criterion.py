"""Base class of criterions, with upstream's construction rule, so that plug-ins written for upstream
fairseq (`--user-dir`) keep working."""

import inspect

from torch import nn


class FairseqCriterion(nn.Module):
    """A criterion: `forward(model, sample, reduce=True) -> (loss, sample_size, logging_output)`, and
    `reduce_metrics(logging_outputs)`, which logs into `fairseq.logging.metrics` (given one summed logging
    output per log interval: subclasses whose logging values are sums say so in
    `logging_outputs_can_be_summed`)."""

    def __init__(self, task):
        super().__init__()
        self.task = task
        dictionary = getattr(task, "target_dictionary", None) if task is not None else None
        # -100 is F.cross_entropy's own default ignore index, used when there is no dictionary.
        self.padding_idx = dictionary.pad() if dictionary is not None else -100

    @classmethod
    def build_criterion(cls, cfg, task, optimization_cfg=None):
        """Upstream's rule: each `__init__` argument is `task`, `cfg` (the criterion's config), or the config
        value of the same name. A name the optimization group also has (`sentence_avg`) is read from there:
        that is where it is parsed."""
        kwargs = {}
        for name, param in list(inspect.signature(cls.__init__).parameters.items())[1:]:
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            if name == "task":
                kwargs[name] = task
            elif name == "cfg":
                kwargs[name] = cfg
            elif optimization_cfg is not None and hasattr(optimization_cfg, name):
                kwargs[name] = getattr(optimization_cfg, name)
            elif hasattr(cfg, name):
                kwargs[name] = getattr(cfg, name)
            elif param.default is param.empty:
                raise ValueError(f"criterion {cls.__name__} needs '{name}', which its config does not have")
        return cls(**kwargs)

    def compile_loss(self, backend: str = "inductor") -> None:
        """--compile: compile the part of the loss worth compiling. The trainer calls it once, before the
        first step; criteria without such a part (the default) leave it a no-op."""

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        raise NotImplementedError

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return False


class LegacyFairseqCriterion(FairseqCriterion):
    """Upstream's base of criterions configured by an argparse namespace: flags come from the `add_args(parser)`
    staticmethod and `__init__(args, task)` takes the whole parsed namespace (also under `self.args`).
    Upstream deprecates it in favour of explicit `__init__` arguments, which FairseqCriterion passes by name."""

    def __init__(self, args, task):
        super().__init__(task)
        self.args = args

    @classmethod
    def build_criterion(cls, cfg, task, optimization_cfg=None):
        return cls(cfg, task)
