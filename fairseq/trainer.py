"""Upstream's module name for fairseq.training.trainer (the same module object, so patching either name patches both)."""

import sys

from fairseq.training import trainer as _module

sys.modules[__name__] = _module
