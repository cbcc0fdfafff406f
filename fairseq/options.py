"""Upstream's module name `fairseq.options`: the same module object as fairseq.frontend.options (the front end
that builds the parsers), so patching either name patches both."""

import sys

from fairseq.frontend import options as _module

sys.modules[__name__] = _module
