"""Upstream's old module name `fairseq.distributed_utils` (`from fairseq import distributed_utils`): the same
module object as fairseq.distributed.utils."""

import sys

from fairseq.distributed import utils as _utils

sys.modules[__name__] = _utils
