"""Token blocks: boundaries for every break mode and block contents, against lists worked out by hand
from upstream fairseq's TokenBlockDataset semantics."""

import numpy as np
import pytest
import torch

from fairseq.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from fairseq.data.token_block_dataset import (
    RandomCropDataset,
    TokenBlockDataset,
    TruncateDataset,
    block_slices,
    maybe_shorten_dataset,
)

EOS, PAD = 2, 1
# Items (token ranges of the stream): 0:[0,3) 1:[3,4) 2:[4,8) 3:[8,9) 4:[9,14) 5:[14,23) 6:[23,25)
# 7:[25,31) 8:[31,32) 9:[32,33) 10:[33,38). Items of one token separate documents in complete_doc.
SIZES = [3, 1, 4, 1, 5, 9, 2, 6, 1, 1, 5]
BLOCK = 6


def slices(sizes, block, mode):
    starts, ends = block_slices(sizes, block, mode)
    return list(zip(starts.tolist(), ends.tolist()))


def test_none_cuts_the_stream_every_block_size_tokens():
    assert slices(SIZES, BLOCK, "none") == [(0, 6), (6, 12), (12, 18), (18, 24), (24, 30), (30, 36), (36, 38)]


def test_complete_packs_whole_items_and_keeps_an_oversized_item_alone():
    # 3+1 (+4 > 6) | 4+1 (+5) | 5 (+9) | 9 alone | 2 (+6) | 6 (+1) | 1+1 (+5) | 5
    assert slices(SIZES, BLOCK, "complete") == [
        (0, 4),
        (4, 9),
        (9, 14),
        (14, 23),
        (23, 25),
        (25, 31),
        (31, 33),
        (33, 38),
    ]


def test_complete_doc_stops_at_separators_and_skips_them():
    # documents: [item 0] sep [item 2] sep [items 4..7] sep sep [item 10]
    assert slices(SIZES, BLOCK, "complete_doc") == [(0, 3), (4, 8), (9, 14), (14, 23), (23, 25), (25, 31), (33, 38)]


def test_eos_gives_one_block_per_item_ignoring_block_size():
    starts = np.cumsum([0] + SIZES[:-1]).tolist()
    ends = np.cumsum(SIZES).tolist()
    assert slices(SIZES, None, "eos") == list(zip(starts, ends))


def test_complete_with_empty_items_lets_an_empty_block_take_an_oversized_item():
    # An empty item starts a block that accepts anything; a trailing empty run makes no block.
    assert slices([0, 7, 0, 2, 2], 4, "complete") == [(0, 7), (7, 11)]
    assert slices([2, 0, 0], 4, "complete") == [(0, 2)]


def test_empty_dataset_and_bad_arguments():
    assert slices([], 4, "none") == []
    assert slices([], 4, "complete") == []
    with pytest.raises(ValueError, match="--sample-break-mode 'sentence'"):
        block_slices(SIZES, 4, "sentence")
    with pytest.raises(ValueError, match="--tokens-per-sample"):
        block_slices(SIZES, 0, "none")


def stream_items():
    """Items whose tokens are 100 + their position in the stream (so contents are easy to check)."""
    tokens = np.arange(100, 100 + sum(SIZES))
    bounds = np.cumsum([0] + SIZES)
    return [torch.from_numpy(tokens[a:b].copy()) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.fixture(scope="module")
def mmap_items(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("blocks") / "train")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for item in stream_items():
        builder.add_item(item)
    builder.finalize(prefix + ".idx")
    return MMapIndexedDataset(prefix)


def blocks_of(dataset, mode, include_targets):
    ds = TokenBlockDataset(
        dataset,
        SIZES,
        BLOCK if mode != "eos" else None,
        pad=PAD,
        eos=EOS,
        break_mode=mode,
        include_targets=include_targets,
    )
    return ds, [ds[i] for i in range(len(ds))]


@pytest.mark.parametrize("source", ["list", "mmap"])
def test_none_mode_sources_start_with_the_previous_token_or_eos(source, mmap_items):
    dataset = stream_items() if source == "list" else mmap_items
    ds, items = blocks_of(dataset, "none", include_targets=True)
    assert ds.sizes.tolist() == [6, 6, 6, 6, 6, 6, 2]
    targets = [t.tolist() for _, t, _ in items]
    sources = [s.tolist() for s, _, _ in items]
    assert targets[0] == [100, 101, 102, 103, 104, 105]
    assert targets[-1] == [136, 137]
    # Block 0 starts item 0: eos. Block 1 starts inside item 2 (offset 2): token 105.
    # Block 4 starts inside item 6 at offset 1: token 123. Block 6 starts inside item 10: token 135.
    assert sources[0] == [EOS, 100, 101, 102, 103, 104]
    assert sources[1] == [105, 106, 107, 108, 109, 110]
    assert sources[4] == [123, 124, 125, 126, 127, 128]
    assert sources[6] == [135, 136]
    assert all(t.dtype == torch.int64 for s, t, _ in items for t in (s, t))


@pytest.mark.parametrize("source", ["list", "mmap"])
def test_complete_blocks_start_at_items_so_sources_start_with_eos(source, mmap_items):
    dataset = stream_items() if source == "list" else mmap_items
    _, items = blocks_of(dataset, "complete", include_targets=True)
    assert [t.tolist() for _, t, _ in items][3] == list(range(114, 123))  # the oversized item 5
    for s, t, _ in items:
        assert s[0].item() == EOS
        assert s[1:].tolist() == t[:-1].tolist()


@pytest.mark.parametrize("mode", ["complete_doc", "eos"])
def test_blocks_without_targets_are_the_token_ranges(mode, mmap_items):
    _, items = blocks_of(mmap_items, mode, include_targets=False)
    expected = slices(SIZES, BLOCK if mode != "eos" else None, mode)
    assert [b.tolist() for b in items] == [list(range(100 + a, 100 + b)) for a, b in expected]


def test_mismatched_sizes_are_rejected():
    with pytest.raises(ValueError, match="3 sizes for a dataset of 11 items"):
        TokenBlockDataset(stream_items(), [1, 2, 3], 4, PAD, EOS)


class Items:
    """A minimal dataset with `sizes` for the shortening wrappers."""

    def __init__(self, items):
        self.items = items
        self.sizes = np.array([len(i) for i in items])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_truncate_cuts_items_and_sizes():
    ds = TruncateDataset(Items(stream_items()), 4)
    assert ds.sizes.tolist() == [3, 1, 4, 1, 4, 4, 2, 4, 1, 1, 4]
    assert ds[5].tolist() == [114, 115, 116, 117]


def test_random_crop_is_a_window_fixed_by_seed_epoch_and_index():
    a = RandomCropDataset(Items(stream_items()), 4, seed=3)
    b = RandomCropDataset(Items(stream_items()), 4, seed=3)
    crop = a[5].tolist()
    assert len(crop) == 4 and crop == list(range(crop[0], crop[0] + 4)) and 114 <= crop[0] <= 119
    assert b[5].tolist() == crop
    assert a[1].tolist() == [103]  # short items are untouched
    starts = set()
    for epoch in range(1, 20):
        a.set_epoch(epoch)
        starts.add(a[5][0].item())
    assert len(starts) > 1  # the window moves between epochs


def test_maybe_shorten_only_listed_splits():
    items = Items(stream_items())
    assert maybe_shorten_dataset(items, "train", "", "none", 4, 1) is items
    assert maybe_shorten_dataset(items, "train", "valid", "truncate", 4, 1) is items
    assert isinstance(maybe_shorten_dataset(items, "valid", "valid,test", "truncate", 4, 1), TruncateDataset)
    assert isinstance(maybe_shorten_dataset(items, "train", "", "random_crop", 4, 1), RandomCropDataset)
