"""`isinstance(x, DTensor)` without importing torch.distributed.tensor.

Importing torch.distributed.tensor costs about a second (it pulls in sympy and its op tables), which every
fairseq process would pay at start-up, `--help` and single-process CPU runs included. No DTensor can exist
before that module is imported (tensor parallelism, FSDP2 and DCP all import it), so until then the answer
is False without importing anything. Code that creates DTensors imports torch.distributed.tensor itself,
in the function that needs it.
"""

import sys

_MODULE = "torch.distributed.tensor"


def is_dtensor(value) -> bool:
    """Whether `value` is a torch.distributed.tensor.DTensor (never imports torch.distributed.tensor)."""
    module = sys.modules.get(_MODULE)
    dtensor = getattr(module, "DTensor", None)  # None also while the module is still being imported
    return dtensor is not None and isinstance(value, dtensor)
