"""Upstream's module name `fairseq.trainer`: the same module object as fairseq.compat.trainer (upstream's
Trainer, the core's fairseq.training.trainer.Trainer with upstream's methods), so patching either name patches
both."""

import sys

from fairseq.compat import trainer as _module

sys.modules[__name__] = _module
