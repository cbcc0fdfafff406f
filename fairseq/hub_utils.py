"""Upstream's module name for fairseq.generation.hub_utils (the same module object, so patching either name patches both)."""

import sys

from fairseq.generation import hub_utils as _module

sys.modules[__name__] = _module
