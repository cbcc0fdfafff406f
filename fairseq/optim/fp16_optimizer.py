"""Upstream's module name `fairseq.optim.fp16_optimizer`: the same module object as fairseq.compat.fp16_optimizer
(the compatibility wing), so patching either name patches both."""

import sys

from fairseq.compat import fp16_optimizer as _module

sys.modules[__name__] = _module
