"""Upstream's module name for fairseq.preprocessing.binarizer (the same module object, so patching either name patches both)."""

import sys

from fairseq.preprocessing import binarizer as _module

sys.modules[__name__] = _module
