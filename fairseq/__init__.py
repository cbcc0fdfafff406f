"""fairseq for large language models on modern PyTorch.

Importing this package is cheap: built-in tasks, models, criterions, optimizers and schedulers are imported
(and so registered) the first time a registry is read.
"""

__version__ = "0.13.0.dev0"

from fairseq import compat as _compat  # noqa: E402

# Upstream's names that live in the compatibility wing: the explaining ImportError for modules this fork leaves
# out (fairseq.upstream_absent) and BaseFairseqModel.from_pretrained (fairseq.compat).
_compat.install()
