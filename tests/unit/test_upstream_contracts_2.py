"""Upstream fairseq contracts that upstream's own unit tests exercise (issue 15's judgment, dry-run in
docs/upstream_api.md): data_utils_fast's batchers, Dictionary.get_count and its duplicate error,
indexed_dataset's module-level entry points, TokenBlockDataset's slice views, MonolingualDataset without
targets, LanguageModelingTask.eval_lm_dataloader (context window) and gen_parser_from_dataclass's nesting."""

import argparse
import io
import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from fairseq.data import Dictionary, MonolingualDataset, TokenBlockDataset, indexed_dataset
from fairseq.data.data_utils_fast import batch_by_size_fn, batch_by_size_vec
from fairseq.dataclass import FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask


# ------------------------------------------------------------------------------------- data_utils_fast


def greedy_batches(sizes, max_tokens, max_sentences, bsz_mult):
    """The rule written out: grow a batch while count * longest <= max_tokens and count <= max_sentences
    (<= 0: no limit); a batch of n > bsz_mult items keeps n - n % bsz_mult of them."""
    batches, start = [], 0
    while start < len(sizes):
        n = 1
        while start + n < len(sizes):
            grown = n + 1
            if max_tokens > 0 and grown * max(sizes[start : start + grown]) > max_tokens:
                break
            if 0 < max_sentences < grown:
                break
            n = grown
        if n > bsz_mult:
            n -= n % bsz_mult
        batches.append(list(range(start, start + n)))
        start += n
    return batches


def as_lists(batches):
    return [b.tolist() for b in batches]


def test_batch_by_size_vec_and_fn_on_spelled_out_cases():
    sizes = np.array([3, 1, 4, 1, 5, 9])
    idx = np.arange(6)
    assert as_lists(batch_by_size_vec(idx, sizes, 10, 0, 1)) == [[0, 1], [2, 3], [4], [5]]
    assert as_lists(batch_by_size_vec(idx, sizes, 0, 3, 2)) == [[0, 1], [2, 3], [4, 5]]  # 3 fit, 2 kept
    assert as_lists(batch_by_size_vec(np.arange(10), np.ones(10, dtype=np.int64), -1, -1, 4)) == [
        list(range(8)),
        [8, 9],
    ]  # -1: no limit; a final batch smaller than the multiple stays whole
    # the order of `indices` is kept and the sizes follow it; the fn variant looks sizes up by index
    order = np.array([5, 0, 2])
    assert as_lists(batch_by_size_vec(order, sizes[order], 10, 0, 1)) == [[5], [0, 2]]
    assert as_lists(batch_by_size_fn(order, lambda i: int(sizes[i]), 10, 0, 1)) == [[5], [0, 2]]
    for batches in (batch_by_size_vec(idx, sizes, 10, 0, 1), batch_by_size_fn(idx, lambda i: sizes[i], 10, 0, 1)):
        assert all(isinstance(b, np.ndarray) and b.dtype == np.int64 for b in batches)


def test_batch_by_size_vec_matches_the_rule_on_a_grid():
    rng = np.random.RandomState(0)
    for n, max_tokens, max_sentences, mult in itertools.product((5, 8), (0, 4, 9), (0, 2, 5), (1, 2, 3)):
        sizes = rng.randint(0, (max_tokens or 6) + 1, size=n)
        expected = greedy_batches(sizes.tolist(), max_tokens, max_sentences, mult)
        assert as_lists(batch_by_size_vec(np.arange(n), sizes, max_tokens, max_sentences, mult)) == expected
        assert as_lists(batch_by_size_fn(np.arange(n), lambda i: sizes[i], max_tokens, max_sentences, mult)) == expected


# ------------------------------------------------------------------------------------------ dictionary


def test_dictionary_get_count_and_duplicate_error():
    d = Dictionary()
    d.add_from_file(io.StringIO("a 7\nb 3\n"))
    assert [d.get_count(d.index(s)) for s in ("a", "b")] == [7, 3]
    assert d.get_count(d.bos()) == 1  # specials are counted once when added
    with pytest.raises(RuntimeError, match="^Duplicate word") as e:  # upstream's message starts so
        Dictionary().add_from_file(io.StringIO("a 1\na 2\n"))
    assert "line 2" in str(e.value) and "#fairseq:overwrite" in str(e.value)


# ---------------------------------------------------------------------------- indexed_dataset entry points


def test_make_dataset_make_builder_and_impl_checks(tmp_path):
    prefix = str(tmp_path / "train")
    builder = indexed_dataset.make_builder(prefix + ".bin", impl="mmap", vocab_size=100)
    assert builder.dtype == np.uint16  # fairseq-preprocess's dtype for a vocabulary under 65500
    for item in ([4, 5, 6], [7]):
        builder.add_item(torch.tensor(item))
    builder.finalize(prefix + ".idx")
    assert indexed_dataset.dataset_exists(prefix, "mmap") and indexed_dataset.infer_dataset_impl(prefix) == "mmap"
    ds = indexed_dataset.make_dataset(prefix, "mmap")
    assert [ds[i].tolist() for i in range(len(ds))] == [[4, 5, 6], [7]] and ds.sizes.tolist() == [3, 1]
    assert indexed_dataset.make_dataset(str(tmp_path / "missing"), "mmap") is None
    assert indexed_dataset.infer_dataset_impl(str(tmp_path / "missing")) is None
    assert indexed_dataset.make_builder(str(tmp_path / "x.bin"), "mmap").dtype == np.uint32  # no vocab size
    for call in (
        lambda: indexed_dataset.make_dataset(prefix, "lazy"),
        lambda: indexed_dataset.make_builder(prefix + ".bin", "cached", 10),
    ):
        with pytest.raises(ValueError, match="impl 'lazy' is not supported|impl 'cached' is not supported"):
            call()


# ------------------------------------------------------------------------------------- token block views


class Items(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = [torch.tensor(x) for x in items]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.parametrize(
    "mode, block, slices, index",
    [
        ("none", 3, [[0, 3], [3, 6], [6, 9], [9, 11]], [[0, 0, 0], [0, 3, 1], [1, 1, 1], [2, 0, 2]]),
        ("complete", 6, [[0, 5], [5, 11]], [[0, 0, 0], [1, 0, 2]]),
        ("eos", None, [[0, 5], [5, 9], [9, 11]], [[0, 0, 0], [1, 0, 1], [2, 0, 2]]),
    ],
)
def test_token_block_slice_indices_and_block_to_dataset_index(mode, block, slices, index):
    items = [[5, 4, 3, 2, 1], [8, 7, 6, 1], [9, 1]]
    ds = TokenBlockDataset(Items(items), [len(x) for x in items], block, pad=0, eos=1, break_mode=mode)
    stream = sum(items, [])
    assert ds.slice_indices.tolist() == slices and ds.block_to_dataset_index.tolist() == index
    assert ds.slice_indices.dtype == ds.block_to_dataset_index.dtype == np.int64
    for i, (start, end) in enumerate(slices):
        assert ds[i].tolist() == stream[start:end]


def test_slice_indices_past_four_billion_tokens_are_integers():
    sizes = [2**31, 2**31, 2**31]  # the views come from the sizes alone: no tokens are read
    ds = TokenBlockDataset(Items([[1]] * 3), sizes, None, pad=0, eos=1, break_mode="eos")
    start, end = ds.slice_indices[-1]
    assert (int(start), int(end)) == (2**32, 3 * 2**31) and not isinstance(end + 1, float)


# ------------------------------------------------------------------ monolingual items and eval_lm_dataloader


def dictionary_of(n):
    d = Dictionary()
    for i in range(n):
        d.add_symbol(f"w{i}")
    d.finalize(padding_factor=1)
    return d


def test_monolingual_dataset_of_plain_token_items_targets_its_source():
    d = dictionary_of(10)
    ds = MonolingualDataset(Items([[4, 5, 6], [7]]), [3, 1], d, add_bos_token=True)
    item = ds[1]
    assert (item["id"], item["source"].tolist(), item["target"]) == (1, [0, 7], None)
    batch = ds.collater([ds[0], ds[1]])
    assert batch["net_input"]["src_tokens"].tolist() == [[0, 4, 5, 6], [0, 7, 1, 1]]
    assert torch.equal(batch["target"], batch["net_input"]["src_tokens"])


def test_eval_lm_dataloader_context_window_in_upstreams_layout():
    d = dictionary_of(10)
    ds = MonolingualDataset(Items([[4, 5, 6], [7, 8, 9], [10, 11]]), [3, 3, 2], d)
    task = LanguageModelingTask(LanguageModelingConfig(tokens_per_sample=3), d)
    batches = list(task.eval_lm_dataloader(ds, batch_size=2, context_window=2, num_workers=0))
    # rows: up to 2 tokens of the text before the block, unscored (pad targets); width = batch width + 2
    assert [b["net_input"]["src_tokens"].tolist() for b in batches] == [
        [[4, 5, 6, 1, 1], [5, 6, 7, 8, 9]],
        [[8, 9, 10, 11]],
    ]
    assert [b["target"].tolist() for b in batches] == [[[4, 5, 6, 1, 1], [1, 1, 7, 8, 9]], [[1, 1, 10, 11]]]
    assert [b["net_input"]["src_lengths"].tolist() for b in batches] == [[3, 5], [4]]
    plain = list(task.eval_lm_dataloader(ds, batch_size=2, num_workers=0))  # no window: the plain batches
    assert sorted(i for b in plain for i in b["id"].tolist()) == [0, 1, 2]
    assert all(torch.equal(b["target"], b["net_input"]["src_tokens"]) for b in plain)


# --------------------------------------------------------------------------- gen_parser_from_dataclass


@dataclass
class Layers(FairseqDataclass):
    data: str = field(default="test", metadata={"help": "data"})
    num_layers: int = field(default=200, metadata={"help": "layers"})


@dataclass
class Stack(FairseqDataclass):
    arch: Layers = field(default_factory=Layers)
    foo: int = field(default=0, metadata={"help": "foo"})


@dataclass
class Model(FairseqDataclass):
    data: str = field(default="test", metadata={"help": "root data"})
    encoder: Stack = field(default_factory=Stack)
    lr: int = field(default=0, metadata={"help": "lr"})


def test_gen_parser_from_dataclass_flattens_nested_dataclasses():
    parser = argparse.ArgumentParser()
    gen_parser_from_dataclass(parser, Stack())
    args = parser.parse_args(["--num-layers", "10", "--foo", "3", "the/data/path"])
    assert (args.num_layers, args.foo, args.data) == (10, 3, "the/data/path")  # `data` is positional


def test_gen_parser_from_dataclass_with_prefix_names_nested_fields():
    parser = argparse.ArgumentParser()
    gen_parser_from_dataclass(parser, Model(), True, "")
    args = parser.parse_args(
        [
            "--encoder-arch-num-layers",
            "10",
            "--encoder-arch-data",
            "D",
            "--encoder-foo",
            "2",
            "--lr",
            "5",
            "the/data/path",
        ]
    )
    assert vars(args) == {
        "encoder_arch_num_layers": 10,
        "encoder_arch_data": "D",
        "encoder_foo": 2,
        "lr": 5,
        "data": "the/data/path",
    }
    assert vars(parser.parse_args([])) == {"data": "test"}  # delete_default: unset flags stay absent
