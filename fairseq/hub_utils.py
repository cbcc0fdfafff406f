"""Upstream's module name for fairseq.hub.hub_utils (the same module object, so patching either name patches both)."""

import sys

from fairseq.hub import hub_utils as _module

sys.modules[__name__] = _module
