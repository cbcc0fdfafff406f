"""fairseq-eval-lm's sliding window: `with_context_window` on hand-made batches, and corpus order."""

import numpy as np
import torch

from fairseq_cli.eval_lm import InCorpusOrder, with_context_window

PAD = 1
# Blocks of a corpus in order (source tokens); batches of rows, right-padded as the collater does.
BATCHES = [[5, 3], [4, 6, 2], [7], [1, 1, 2]]


def make_batches(layout=BATCHES):
    """Source tokens count up from 10 through the corpus; the target of token t is t + 1000 (never pad)."""
    next_token = 10
    out, blocks = [], []
    sample_id = 0
    for rows in layout:
        width = max(rows)
        src = torch.full((len(rows), width), PAD, dtype=torch.long)
        tgt = torch.full((len(rows), width), PAD, dtype=torch.long)
        for i, n in enumerate(rows):
            tokens = list(range(next_token, next_token + n))
            next_token += n
            blocks.append(tokens)
            src[i, :n] = torch.tensor(tokens)
            tgt[i, :n] = torch.tensor(tokens) + 1000
        ids = torch.arange(sample_id, sample_id + len(rows))
        sample_id += len(rows)
        out.append(
            {
                "id": ids,
                "nsentences": len(rows),
                "ntokens": sum(rows),
                "net_input": {"src_tokens": src, "src_lengths": torch.tensor(rows)},
                "target": tgt,
            }
        )
    return out, blocks


def expected_rows(blocks, window):
    """(source, target) of every row: the `window` corpus tokens before the block, then the block."""
    corpus = [t for b in blocks for t in b]
    rows, start = [], 0
    for b in blocks:
        ctx = corpus[max(0, start - window) : start]
        rows.append((ctx + b, [PAD] * len(ctx) + [t + 1000 for t in b]))
        start += len(b)
    return rows


def unpadded_rows(sample):
    rows = []
    src, tgt, lengths = sample["net_input"]["src_tokens"], sample["target"], sample["net_input"]["src_lengths"]
    for i in range(src.size(0)):
        n = int(lengths[i])
        assert torch.all(src[i, n:] == PAD) and torch.all(tgt[i, n:] == PAD)
        rows.append((src[i, :n].tolist(), tgt[i, :n].tolist()))
    return rows


def test_each_row_gets_the_preceding_context_across_batches():
    batches, blocks = make_batches()
    out = list(with_context_window(iter(batches), context_window=4, pad=PAD))
    assert len(out) == len(batches)
    got = [row for sample in out for row in unpadded_rows(sample)]
    assert got == expected_rows(blocks, 4)
    # spelled out for the first rows: no context for the first block; the 3-token block gets 4 tokens of the
    # first; the first row of batch 2 gets the last token of block 1 and all of block 2
    assert got[0] == ([10, 11, 12, 13, 14], [1010, 1011, 1012, 1013, 1014])
    assert got[1] == ([11, 12, 13, 14, 15, 16, 17], [PAD] * 4 + [1015, 1016, 1017])
    assert got[2] == ([14, 15, 16, 17, 18, 19, 20, 21], [PAD] * 4 + [1018, 1019, 1020, 1021])


def test_padding_width_and_lengths():
    batches, blocks = make_batches()
    out = list(with_context_window(iter(batches), context_window=4, pad=PAD))
    exp = expected_rows(blocks, 4)
    k = 0
    for sample in out:
        src, tgt = sample["net_input"]["src_tokens"], sample["target"]
        lengths = [len(s) for s, _ in exp[k : k + src.size(0)]]
        assert sample["net_input"]["src_lengths"].tolist() == lengths
        assert src.shape == tgt.shape == (len(lengths), max(lengths))
        assert src.dtype == tgt.dtype == torch.long
        k += src.size(0)
    assert k == len(blocks)


def test_counted_targets_are_unchanged_and_counted_once():
    batches, blocks = make_batches()
    original_targets = [t for s in batches for t in s["target"][s["target"].ne(PAD)].tolist()]
    for window in (1, 3, 4, 9, 100):
        out = list(with_context_window(iter(make_batches()[0]), context_window=window, pad=PAD))
        counted = [t for s in out for t in s["target"][s["target"].ne(PAD)].tolist()]
        assert counted == original_targets, window
        assert [row for s in out for row in unpadded_rows(s)] == expected_rows(blocks, window), window


def test_other_fields_kept_and_input_not_modified():
    batches, _ = make_batches()
    before = [(s["net_input"]["src_tokens"].clone(), s["target"].clone()) for s in batches]
    out = list(with_context_window(iter(batches), context_window=4, pad=PAD))
    for sample, orig, (src, tgt) in zip(out, batches, before):
        assert torch.equal(sample["id"], orig["id"])
        assert sample["ntokens"] == orig["ntokens"] and sample["nsentences"] == orig["nsentences"]
        assert torch.equal(orig["net_input"]["src_tokens"], src) and torch.equal(orig["target"], tgt)


def test_zero_window_adds_no_context():
    batches, blocks = make_batches()
    out = list(with_context_window(iter(batches), context_window=0, pad=PAD))
    assert [row for s in out for row in unpadded_rows(s)] == expected_rows(blocks, 0)


def test_is_lazy():
    """A generator: the next batch is not read before the current one is consumed (eval streams batches)."""
    batches, _ = make_batches()
    consumed = []

    def source():
        for s in batches:
            consumed.append(int(s["id"][0]))
            yield s

    gen = with_context_window(source(), context_window=2, pad=PAD)
    next(gen)
    assert consumed == [0]


class SizedDataset:
    def __init__(self, sizes):
        self.sizes = np.array(sizes)

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        return {"id": i, "size": int(self.sizes[i])}

    def collater(self, samples):
        return [s["id"] for s in samples]

    def ordered_indices(self):
        return np.argsort(self.sizes, kind="mergesort")  # what a size-sorted dataset would do


def test_in_corpus_order():
    inner = SizedDataset([5, 1, 9, 3, 3])
    ds = InCorpusOrder(inner)
    assert np.array_equal(ds.ordered_indices(), np.arange(5))
    assert len(ds) == 5
    assert ds[2] == {"id": 2, "size": 9}
    assert ds.collater([ds[3], ds[0]]) == [3, 0]
    assert ds.sizes is inner.sizes
