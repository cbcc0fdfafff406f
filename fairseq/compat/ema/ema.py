"""Upstream's module name `fairseq.models.ema.ema`: the same module object as fairseq.training.ema, so patching
either name patches both."""

import sys

from fairseq.training import ema as _module

sys.modules[__name__] = _module
