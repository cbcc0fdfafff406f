"""Upstream's module name `fairseq.utils`: the same module object as fairseq.compat.utils (the compatibility
wing), so patching either name patches both."""

import sys

from fairseq.compat import utils as _module

sys.modules[__name__] = _module
