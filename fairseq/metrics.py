"""Upstream's `fairseq.metrics` (plug-ins import it): the very module `fairseq.logging.metrics`, so both names
share one set of aggregators."""

import sys

from fairseq.logging import metrics as _metrics

sys.modules[__name__] = _metrics
