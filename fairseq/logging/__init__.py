"""Logging for training: meters and named aggregations (`metrics`), per-step sums turned into numbers once
per log interval (`logging_outputs`), upstream-format progress bars with TensorBoard / W&B wrappers
(`progress_bar`), and GPU memory statistics (`memory`).

Import the submodules directly (`from fairseq.logging import metrics`); importing this package loads
nothing else.
"""
