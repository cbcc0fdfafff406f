"""Upstream's `fairseq.models.ema`: an exponential moving average of a model's weights (`--store-ema`). The
trainer owns it: fairseq.training.ema; its submodule `fairseq.models.ema.ema` is the same module object."""

from fairseq.training.ema import EMA, build_ema, check_ema_config

__all__ = ["EMA", "build_ema", "check_ema_config"]
