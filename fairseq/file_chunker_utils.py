"""Upstream's module name for fairseq.preprocessing.file_chunker_utils (the same module object, so patching either name patches both)."""

import sys

from fairseq.preprocessing import file_chunker_utils as _module

sys.modules[__name__] = _module
