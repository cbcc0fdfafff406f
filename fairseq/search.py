"""Upstream's module name for fairseq.generation.search (the same module object, so patching either name patches both)."""

import sys

from fairseq.generation import search as _module

sys.modules[__name__] = _module
