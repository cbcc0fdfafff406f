"""Upstream's module name `fairseq.file_io`: the same module object as fairseq.compat.file_io (the compatibility
wing), so patching either name patches both."""

import sys

from fairseq.compat import file_io as _module

sys.modules[__name__] = _module
