"""Upstream's module name for fairseq.modules.fairseq_incremental_decoder (the same module object)."""

import sys

from fairseq.modules import fairseq_incremental_decoder as _module

sys.modules[__name__] = _module
