"""Upstream's module name for fairseq.modules.incremental_decoding_utils (the same module object, so patching either name patches both)."""

import sys

from fairseq.modules import incremental_decoding_utils as _module

sys.modules[__name__] = _module
