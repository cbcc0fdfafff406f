"""Upstream's `fairseq.models.ema`: an exponential moving average of a model's weights (`--store-ema`)."""

from fairseq.models.ema.ema import EMA, build_ema, check_ema_config

__all__ = ["EMA", "build_ema", "check_ema_config"]
