"""Sliding-window evaluation of a language model (`fairseq-eval-lm --context-window N`, upstream's
`LanguageModelingTask.eval_lm_dataloader(..., context_window=N)`).

Blocks are read in corpus order (`InCorpusOrder`) and each gets up to N tokens of the text before it as left
context (`with_context_window`): the context is scored by the model but its targets are padding, so every
token is counted once, with more history than its block alone gives.
"""

from typing import Optional

import numpy as np
import torch


class InCorpusOrder:
    """A dataset view whose batches come in corpus order (no size sorting, no shuffling), as the
    sliding-window evaluation needs: each block's context is the text just before it."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.sizes = dataset.sizes

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def collater(self, samples):
        return self.dataset.collater(samples)

    def ordered_indices(self):
        return np.arange(len(self.dataset))


def with_context_window(
    batches, context_window: int, pad: int, bos: Optional[int] = None, width_with_window: bool = False
):
    """Give each block up to `context_window` tokens of the text before it as left context.

    Blocks must come in corpus order. With `bos` (--add-bos-token), only the first block keeps its leading <s>:
    later blocks continue the text. Rows are right-padded to the longest row, or with `width_with_window` to the
    batch's width plus `context_window` (upstream's LMContextWindowDataset layout, which eval_lm_dataloader
    keeps); the padding is neither scored nor counted either way.
    """
    history = torch.empty(0, dtype=torch.long)
    for sample in batches:
        src, tgt = sample["net_input"]["src_tokens"], sample["target"]
        rows_src, rows_tgt = [], []
        for i in range(src.size(0)):
            n = int(tgt[i].ne(pad).sum())
            tokens, targets = src[i, :n], tgt[i, :n]
            if bos is not None and len(history) and n and tokens[0] == bos:
                tokens, targets = tokens[1:], targets[1:]
            ctx = history[-context_window:] if context_window > 0 else history[:0]
            rows_src.append(torch.cat([ctx, tokens]))
            rows_tgt.append(torch.cat([torch.full_like(ctx, pad), targets]))
            history = torch.cat([history, tokens])[-context_window:] if context_window > 0 else history
        width = src.size(1) + context_window if width_with_window else max(len(r) for r in rows_src)
        new_src = torch.full((len(rows_src), width), pad, dtype=torch.long)
        new_tgt = torch.full((len(rows_src), width), pad, dtype=torch.long)
        for i, (s, t) in enumerate(zip(rows_src, rows_tgt)):
            new_src[i, : len(s)] = s
            new_tgt[i, : len(t)] = t
        sample = dict(sample)
        sample["net_input"] = dict(
            sample["net_input"], src_tokens=new_src, src_lengths=torch.tensor([len(r) for r in rows_src])
        )
        sample["target"] = new_tgt
        yield sample
