"""Upstream's module name for fairseq.generation.sequence_scorer (the same module object, so patching either name patches both)."""

import sys

from fairseq.generation import sequence_scorer as _module

sys.modules[__name__] = _module
