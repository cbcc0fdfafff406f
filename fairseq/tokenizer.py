"""Upstream's module name `fairseq.tokenizer`: the same module object as fairseq.compat.tokenizer (the compatibility
wing), so patching either name patches both."""

import sys

from fairseq.compat import tokenizer as _module

sys.modules[__name__] = _module
