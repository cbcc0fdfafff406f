"""Upstream's `fairseq.models.ema` (served from the compat wing through fairseq.upstream_absent's table): an
exponential moving average of a model's weights (`--store-ema`). The trainer owns it: fairseq.training.ema; the
submodule `fairseq.models.ema.ema` is the same module object as fairseq.training.ema."""

from fairseq.training.ema import EMA, build_ema, check_ema_config

__all__ = ["EMA", "build_ema", "check_ema_config"]
