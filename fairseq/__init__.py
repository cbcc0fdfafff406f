"""fairseq for large language models on modern PyTorch.

Importing this package is cheap: built-in tasks, models, criterions, optimizers and schedulers are imported
(and so registered) the first time a registry is read.
"""

__version__ = "0.13.0.dev0"

from fairseq import upstream_absent as _upstream_absent  # noqa: E402

# Upstream's modules this fork leaves out raise an ImportError that says why and what to use instead.
_upstream_absent.install()
