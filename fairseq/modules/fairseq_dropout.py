"""Upstream's `FairseqDropout`: dropout that a generator can keep on at inference (`--retain-dropout`)."""

import logging
from typing import List, Optional

import torch.nn as nn
import torch.nn.functional as F

logger = logging.getLogger(__name__)


class FairseqDropout(nn.Module):
    """Dropout with probability `p` in training; at inference too once `make_generation_fast_(name,
    retain_dropout=True)` has said so (for this module, or for its `module_name` among `retain_dropout_modules`)."""

    def __init__(self, p: float, module_name: Optional[str] = None):
        super().__init__()
        self.p = p
        self.module_name = module_name
        self.apply_during_inference = False

    def forward(self, x, inplace: bool = False):
        if self.p > 0 and (self.training or self.apply_during_inference):
            return F.dropout(x, p=self.p, training=True, inplace=inplace)
        return x

    def make_generation_fast_(
        self, name: str, retain_dropout: bool = False, retain_dropout_modules: Optional[List[str]] = None, **kwargs
    ) -> None:
        if not retain_dropout:
            return
        if retain_dropout_modules is None or self.module_name in retain_dropout_modules:
            logger.info(f"Enabling dropout during inference for module: {name}")
            self.apply_during_inference = True
        else:
            logger.info(f"Disabling dropout for module: {name}")

    def extra_repr(self) -> str:
        return f"p={self.p}"
