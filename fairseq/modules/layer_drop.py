"""Upstream's `LayerDropModuleList` (LayerDrop, https://arxiv.org/abs/1909.11556): iterating it in training
skips each module with probability `p`; in eval mode every module is kept. (transformer_lm refuses
--decoder-layerdrop; this list is for plug-in models.)"""

import torch
import torch.nn as nn


class LayerDropModuleList(nn.ModuleList):
    def __init__(self, p: float, modules=None):
        super().__init__(modules)
        self.p = p

    def __iter__(self):
        draws = torch.empty(len(self)).uniform_()
        for i, module in enumerate(super().__iter__()):
            if not self.training or draws[i] > self.p:
                yield module
