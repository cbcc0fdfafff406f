"""fairseq for large language models on modern PyTorch.

Importing this package is cheap: built-in tasks, models, criterions, optimizers and schedulers are imported
(and so registered) the first time a registry is read.
"""

__version__ = "0.13.0.dev0"
