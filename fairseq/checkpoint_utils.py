"""Upstream's module name `fairseq.checkpoint_utils`: the same module object as fairseq.compat.checkpoint_utils (the compatibility
wing), so patching either name patches both."""

import sys

from fairseq.compat import checkpoint_utils as _module

sys.modules[__name__] = _module
