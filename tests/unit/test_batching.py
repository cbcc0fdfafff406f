"""batch_by_size: --max-tokens, --batch-size and --required-batch-size-multiple with upstream's rules."""

import numpy as np
import pytest

from fairseq.data.batching import batch_by_size, filter_by_size, resolve_limit


def batches(sizes, **kwargs):
    return batch_by_size(np.arange(len(sizes)), sizes, **kwargs).to_list()


def test_max_tokens_counts_items_times_the_longest():
    # 2,3,3 -> 3*3 = 9 (adding 5 makes 4*5 = 20); 5,5 -> 10; 5 alone (2*8 = 16); 8.
    assert batches([2, 3, 3, 5, 5, 5, 8], max_tokens=10) == [[0, 1, 2], [3, 4], [5], [6]]


def test_order_of_indices_is_kept_and_sizes_follow_it():
    got = batch_by_size([9, 4, 7, 1], [4, 4, 6, 6], max_tokens=12).to_list()
    assert got == [[9, 4], [7, 1]]


def test_batch_size_alone():
    assert batches([1] * 7, max_sentences=3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_both_limits_the_tighter_wins():
    assert batches([4] * 10, max_tokens=16, max_sentences=3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert batches([4] * 10, max_tokens=8, max_sentences=3) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_required_multiple_rounds_batches_down_and_splits_the_leftover():
    # 10 fit, rounded down to 8; the last 7 fit -> 4, then 3 (fewer than the multiple stay as they are).
    sizes = [len(b) for b in batches([1] * 23, max_sentences=10, required_batch_size_multiple=4)]
    assert sizes == [8, 8, 4, 3]


def test_required_multiple_larger_than_what_fits_keeps_what_fits():
    sizes = [len(b) for b in batches([5] * 7, max_tokens=15, required_batch_size_multiple=8)]
    assert sizes == [3, 3, 1]


def test_item_longer_than_max_tokens_is_an_error_naming_the_flag():
    with pytest.raises(ValueError, match=r"item 2 has 9 tokens, more than --max-tokens 8.*--skip-invalid-size"):
        batches([1, 2, 9], max_tokens=8)


def test_filter_by_size_drops_or_fails():
    kept, dropped = filter_by_size([0, 1, 2, 3], np.array([5, 9, 3, 12]), 8, ignore_invalid=True)
    assert kept.tolist() == [0, 2] and dropped.tolist() == [1, 3]
    kept, dropped = filter_by_size([0, 2], np.array([5, 9, 3, 12]), None, ignore_invalid=False)
    assert kept.tolist() == [0, 2] and dropped.tolist() == []
    with pytest.raises(
        ValueError, match="item 1 has 9 tokens, more than --tokens-per-sample / --max-target-positions 8"
    ):
        filter_by_size([0, 1], np.array([5, 9]), 8, ignore_invalid=False)


def test_resolve_limit():
    assert resolve_limit(None, 1024, (512, 512), None) == 512
    assert resolve_limit(None, None) is None


def test_empty_input():
    assert batches([], max_tokens=8) == []


def reference_batches(sizes, max_tokens, max_sentences, multiple):
    """The batching rule, stated directly: from each start take as many items as fit (count * longest
    <= max_tokens, count <= max_sentences); keep them all if fewer than the multiple, else round down."""
    out, start, n = [], 0, len(sizes)
    while start < n:
        count, longest = 0, 0
        while start + count < n:
            new_longest = max(longest, sizes[start + count])
            if (max_sentences and count + 1 > max_sentences) or (max_tokens and (count + 1) * new_longest > max_tokens):
                break
            count, longest = count + 1, new_longest
        take = count if count < multiple else count - count % multiple
        out.append(list(range(start, start + take)))
        start += take
    return out


@pytest.mark.parametrize(
    "max_tokens,max_sentences,multiple", [(4096, None, 8), (3000, 40, 1), (None, 24, 8), (60000, None, 3)]
)
def test_vectorized_batching_matches_the_rule_across_chunk_boundaries(max_tokens, max_sentences, multiple):
    sizes = np.random.default_rng(0).integers(1, 300, 70_000)  # more than one 65,536-item chunk
    got = batch_by_size(
        np.arange(len(sizes)),
        sizes,
        max_tokens=max_tokens,
        max_sentences=max_sentences,
        required_batch_size_multiple=multiple,
    ).to_list()
    assert got == reference_batches(sizes.tolist(), max_tokens, max_sentences, multiple)


def test_a_million_equal_blocks():
    sizes = np.full(1_000_000, 512)
    result = batch_by_size(np.arange(len(sizes)), sizes, max_tokens=4096, required_batch_size_multiple=8)
    assert len(result) == 125_000 and set(result.sizes().tolist()) == {8}


# ---- which flag set the size limit (--max-tokens or the positions limit) -------------------------------
def test_size_limit_names_the_flag_that_set_it():
    from fairseq.data.batching import POSITIONS_FLAGS, size_limit

    assert size_limit(1024, 256) == (256, "--max-tokens")
    assert size_limit(128, 256) == (128, POSITIONS_FLAGS)
    assert size_limit((512, 512), None) == (512, POSITIONS_FLAGS)
    assert size_limit(None, 256) == (256, "--max-tokens")
    assert size_limit(None, None) == (None, POSITIONS_FLAGS)
    assert size_limit(None, 0) == (None, POSITIONS_FLAGS)  # 0: no token budget, as batch_by_size reads it
    # a positions limit already lowered to --max-tokens (upstream's resolve_max_positions(..., max_tokens))
    assert size_limit(resolve_limit(1024, 256), 256) == (256, "--max-tokens")


class _Items:
    def __init__(self, sizes):
        self.sizes = np.asarray(sizes)

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        return {"id": i}

    def ordered_indices(self):
        return np.argsort(self.sizes, kind="stable")

    def collater(self, items):
        return items


def test_skip_warning_names_max_tokens_when_it_set_the_limit(caplog):
    from fairseq.tasks.fairseq_task import FairseqTask

    task = FairseqTask(None)
    data = _Items([4, 40, 8, 40])
    with caplog.at_level("WARNING", logger="fairseq.tasks.fairseq_task"):
        # what fairseq-train passed before: min(positions, --max-tokens) as the positions limit
        itr = task.get_batch_iterator(
            data, max_tokens=16, max_positions=resolve_limit(1024, 16), ignore_invalid_inputs=True
        )
    assert "2 items longer than --max-tokens 16 are skipped" in caplog.text
    assert "max positions" not in caplog.text
    assert itr.size_report.num_dropped == 2 and itr.size_report.longest == 40
    caplog.clear()
    with caplog.at_level("WARNING", logger="fairseq.tasks.fairseq_task"):
        task.get_batch_iterator(data, max_tokens=64, max_positions=32, ignore_invalid_inputs=True)
    assert "2 items longer than --tokens-per-sample / --max-target-positions 32 are skipped" in caplog.text


def test_no_batches_message_names_the_cause_and_the_fix():
    from fairseq.tasks.fairseq_task import FairseqTask

    task = FairseqTask(None)
    itr = task.get_batch_iterator(_Items([20, 40]), max_tokens=16, ignore_invalid_inputs=True)
    assert len(itr.frozen_batches) == 0
    assert task.no_batches_message("train", itr) == (
        "no training batch: all 2 items of the training split 'train' are longer than --max-tokens 16 (the "
        "longest has 40 tokens); raise --max-tokens to at least 40 (the longest item)"
    )
    empty = task.get_batch_iterator(_Items([]), max_tokens=16)
    assert task.no_batches_message("valid", empty, "validation").startswith(
        "no validation batch: the validation subset 'valid' is empty; drop it from --valid-subset"
    )
