"""Upstream's data API (issue 15): iterators, dataset classes, data_utils, the binarizer classes, the file
chunker and Dictionary.add_file_to_dictionary, against upstream's documented behaviour."""

import collections

import numpy as np
import pytest
import torch

from fairseq.data import (
    ConcatDataset,
    Dictionary,
    FairseqDataset,
    ListDataset,
    MMapIndexedDataset,
    ResamplingDataset,
    data_utils,
    iterators,
)


# ------------------------------------------------------------------------------------------ iterators


def test_counting_iterator_skip_take_and_length_checks():
    itr = iterators.CountingIterator(list(range(10)))
    assert (next(itr), next(itr), itr.n) == (0, 1, 2)
    itr.skip(3)
    assert (itr.n, next(itr)) == (5, 5)
    itr.skip(2)
    assert list(itr) == [8, 9] and not itr.has_next()
    assert list(iterators.CountingIterator(list(range(10)), total=8)) == list(range(8))  # the rest is ignored
    with pytest.raises(IndexError):
        list(iterators.CountingIterator(list(range(10)), total=12))
    taken = iterators.CountingIterator(list(range(10))).take(5)
    assert len(taken) == 5 and list(taken) == [0, 1, 2, 3, 4]


def test_buffered_iterator_reads_ahead_and_takes_through():
    buffered = iterators.BufferedIterator(2, list(range(10)))
    itr = iterators.CountingIterator(buffered).take(5)
    assert len(buffered) == 5  # take reaches the buffered reader
    assert list(itr) == [0, 1, 2, 3, 4]
    with pytest.raises(StopIteration):
        next(buffered)
    resumed = iterators.BufferedIterator(2, list(range(4, 10)))
    itr = iterators.CountingIterator(resumed, start=4).take(5)  # 4 already consumed: 1 more item wanted
    assert len(itr) == 5 and len(resumed) == 1 and next(itr) == 4 and not itr.has_next()

    def failing():
        yield 1
        raise RuntimeError("reader failed")

    class Sized:
        def __len__(self):
            return 3

        def __iter__(self):
            return failing()

    broken = iterators.BufferedIterator(2, Sized())
    assert next(broken) == 1
    with pytest.raises(RuntimeError, match="reader failed"):
        next(broken)


def test_grouped_and_sharded_iterators():
    assert list(iterators.GroupedIterator(list(range(10)), 4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(iterators.GroupedIterator(list(range(10)), 4, skip_remainder_batch=True)) == 2
    assert list(iterators.ShardedIterator(list(range(10)), 3, 1)) == [1, 4, 7, None]
    assert list(iterators.ShardedIterator(list(range(10)), 3, 2, fill_value=[])) == [2, 5, 8, []]
    assert list(iterators.ShardedIterator(list(range(10)), 2, 0)) == [0, 2, 4, 6, 8]
    with pytest.raises(ValueError, match="shard_id 3"):
        iterators.ShardedIterator([1], 3, 3)


def _epoch_itr(items, bsz, **kwargs):
    dataset = ListDataset(items)
    batches = [list(range(s, min(s + bsz, len(items)))) for s in range(0, len(items), bsz)]
    return iterators.EpochBatchIterator(dataset=dataset, collate_fn=dataset.collater, batch_sampler=batches, **kwargs)


def test_epoch_batch_iterator_skip_remainder_batch():
    # upstream drops the last batch of an epoch whether or not it is full
    for items, bsz, skip, expected in [
        ([1, 2, 3], 2, True, 1),
        ([1, 2, 3], 2, False, 2),
        ([1, 2, 3], 1, True, 2),
        ([1, 2, 3], 4, True, 0),
        ([1, 2, 3], 4, False, 1),
    ]:
        itr = _epoch_itr(items, bsz, skip_remainder_batch=skip).next_epoch_itr(shuffle=False)
        assert len(itr) == expected and len(list(itr)) == expected
    grouped = iterators.GroupedIterator(_epoch_itr(list(range(9)), 3).next_epoch_itr(), 2, skip_remainder_batch=True)
    assert len(grouped) == 1


def test_epoch_batch_iterator_shuffling_options():
    items = list(range(12))
    plain = [b for b in _epoch_itr(items, 2, seed=3).next_epoch_itr(shuffle=True)]
    assert [b for b in _epoch_itr(items, 2, seed=3, disable_shuffling=True).next_epoch_itr(shuffle=True)] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [8, 9],
        [10, 11],
    ]
    assert plain != [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    # grouped: runs of num_shards batches shuffled together (a last incomplete run is left out)
    order = iterators.shuffled_batch_order(7, seed=3, epoch=1, group_size=2)
    groups = np.random.RandomState(4).permutation(3)
    assert order.tolist() == [b for g in groups for b in (2 * g, 2 * g + 1)]
    rank0 = _epoch_itr(list(range(14)), 2, seed=3, num_shards=2, shard_id=0, grouped_shuffling=True)
    assert rank0.batch_order(1, True).tolist() == order[0::2].tolist()


def test_epoch_batch_iterator_callable_batch_sampler_and_reused_dataloader():
    dataset = ListDataset(list(range(6)))
    calls = []

    def sampler(ds, epoch):
        calls.append(epoch)
        return [[i] for i in range(epoch)]  # epoch e has e batches

    itr = iterators.EpochBatchIterator(dataset, dataset.collater, sampler, reuse_dataloader=True)
    assert [list(itr.next_epoch_itr(shuffle=False)) for _ in range(3)] == [[[0]], [[0], [1]], [[0], [1], [2]]]
    assert calls == [1, 2, 3] and itr._dataloader is not None and itr.n == 3


# ------------------------------------------------------------------------------------------ datasets


class Sized(FairseqDataset):
    def __init__(self, sizes):
        self.sizes = np.asarray(sizes)

    def __getitem__(self, index):
        return torch.arange(int(self.sizes[index]))

    def __len__(self):
        return len(self.sizes)


def test_fairseq_dataset_sizes_batching_and_filtering():
    ds = Sized([3, 5, 2, 8, 1])
    assert ds.num_tokens(1) == 5 and ds.num_tokens_vec([0, 3]).tolist() == [3, 8] and ds.size(4) == 1
    batches = ds.batch_by_size(np.array([4, 2, 0, 1, 3]), max_tokens=10)
    assert [b.tolist() for b in batches] == [[4, 2, 0], [1], [3]]  # 3 * 3 <= 10, then 5 alone, 8 alone
    kept, ignored = ds.filter_indices_by_size(np.arange(5), 4)
    assert kept.tolist() == [0, 2, 4] and ignored == [1, 3]
    assert ds.ordered_indices().tolist() == [0, 1, 2, 3, 4] and ds.can_reuse_epoch_itr_across_epochs


def _batch_by_size_reference(sizes, max_tokens, max_sentences, multiple):
    """Upstream's documented rule, written out: fill while count * longest fits, then round the count down
    to a multiple when it is at least the multiple."""
    batches, start = [], 0
    while start < len(sizes):
        end = start
        while end < len(sizes):
            count, longest = end - start + 1, max(sizes[start : end + 1])
            if (max_tokens > 0 and count * longest > max_tokens) or (max_sentences > 0 and count > max_sentences):
                break
            end += 1
        count = max(end - start, 1)
        if count >= multiple:
            count -= count % multiple
        batches.append(list(range(start, start + count)))
        start += count
    return batches


def test_data_utils_batch_by_size_matches_upstreams_rule():
    rng = np.random.RandomState(0)
    for _ in range(60):
        sizes = rng.randint(1, 9, size=rng.randint(1, 12))
        max_tokens, max_sentences, multiple = int(rng.randint(9, 20)), int(rng.randint(0, 5)), int(rng.randint(1, 4))
        indices = np.arange(len(sizes))
        expected = _batch_by_size_reference(list(sizes), max_tokens, max_sentences, multiple)
        by_fn = data_utils.batch_by_size(
            indices,
            lambda i: sizes[i],
            max_tokens=max_tokens,
            max_sentences=max_sentences,
            required_batch_size_multiple=multiple,
        )
        by_vec = data_utils.batch_by_size(
            indices,
            None,
            num_tokens_vec=sizes,
            max_tokens=max_tokens,
            max_sentences=max_sentences,
            required_batch_size_multiple=multiple,
        )
        assert [b.tolist() for b in by_fn] == [b.tolist() for b in by_vec] == expected


def test_numpy_seed_and_collate_tokens():
    np.random.seed(5)
    expected_after = np.random.rand()
    np.random.seed(5)
    with data_utils.numpy_seed(11):
        inside = np.random.rand()
    assert np.random.rand() == expected_after and inside == np.random.RandomState(11).rand()
    rows = [torch.tensor([4, 5, 2]), torch.tensor([6, 2])]
    assert data_utils.collate_tokens(rows, 1).tolist() == [[4, 5, 2], [6, 2, 1]]
    assert data_utils.collate_tokens(rows, 1, left_pad=True).tolist() == [[4, 5, 2], [1, 6, 2]]
    assert data_utils.collate_tokens(rows, 1, eos_idx=2, move_eos_to_beginning=True).tolist() == [[2, 4, 5], [2, 6, 1]]
    assert data_utils.collate_tokens(rows, 1, pad_to_multiple=4, pad_to_bsz=3).shape == (3, 4)


def test_list_concat_and_resampling_datasets():
    strings = ListDataset(["ab", "c", "def", "ghij"], np.array([2, 1, 3, 4]))
    assert strings.collater([strings[0], strings[2]]) == ["ab", "def"] and strings.num_tokens(3) == 4
    concat = ConcatDataset(
        [ListDataset([10, 11], np.array([1, 1])), ListDataset([20, 21, 22], np.array([2, 3, 5]))], sample_ratios=[2, 1]
    )
    assert len(concat) == 7 and [concat[i] for i in range(7)] == [10, 11, 10, 11, 20, 21, 22]
    assert concat.sizes.tolist() == [1, 1, 1, 1, 2, 3, 5] and concat.size(6) == 5
    assert concat.ordered_indices().tolist()[-1] == 6

    weights = [4.0, 2.0, 7.0, 1.5]
    resampled = ResamplingDataset(strings, weights, size_ratio=2, seed=0, epoch=1)
    assert len(resampled) == 8 and not resampled.can_reuse_epoch_itr_across_epochs
    freqs = collections.Counter()
    for epoch in range(300):
        resampled.set_epoch(epoch)
        draws = np.random.RandomState([42, 0, epoch]).choice(4, 8, replace=True, p=np.array(weights) / sum(weights))
        assert [resampled[i] for i in range(8)] == [strings[int(d)] for d in draws]  # upstream's draws
        order = resampled.ordered_indices()
        assert [resampled.size(i) for i in order] == sorted(resampled.size(i) for i in order)
        freqs.update(resampled[i] for i in range(8))
    total = sum(freqs.values())
    for s, w in zip(["ab", "c", "def", "ghij"], weights):
        assert abs(freqs[s] / total - w / sum(weights)) < 0.03
    with pytest.raises(ValueError, match="without replacement needs size_ratio < 1"):
        ResamplingDataset(strings, replace=False, size_ratio=1.0)


def test_load_indexed_dataset_combine_reads_numbered_splits(tmp_path):
    from fairseq.data.indexed_dataset import MMapIndexedDatasetBuilder

    for name, rows in (("valid", [[4, 5], [6]]), ("valid1", [[7, 8, 9]]), ("valid3", [[4]])):
        builder = MMapIndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), dtype=np.int32)
        for row in rows:
            builder.add_item(torch.tensor(row))
        builder.finalize(str(tmp_path / f"{name}.idx"))
    single = data_utils.load_indexed_dataset(str(tmp_path / "valid"))
    assert isinstance(single, MMapIndexedDataset) and len(single) == 2
    combined = data_utils.load_indexed_dataset(str(tmp_path / "valid"), combine=True)
    assert isinstance(combined, ConcatDataset)  # valid + valid1; valid3 follows a gap, as upstream stops
    assert [combined[i].tolist() for i in range(len(combined))] == [[4, 5], [6], [7, 8, 9]]
    assert combined.sizes.tolist() == [2, 1, 3]
    assert data_utils.find_extra_valid_paths(str(tmp_path)) == {"valid1", "valid3"}


def test_unused_numbered_valid_splits_are_an_error(tmp_path):
    from types import SimpleNamespace

    (tmp_path / "valid1.bin").write_bytes(b"")
    cfg = SimpleNamespace(
        task=SimpleNamespace(data=str(tmp_path)),
        dataset=SimpleNamespace(
            ignore_unused_valid_subsets=False,
            combine_valid_subsets=None,
            disable_validation=False,
            valid_subset="valid",
        ),
    )
    with pytest.raises(ValueError, match=r"\['valid1'\].*--combine-valid-subsets.*--ignore-unused-valid-subsets"):
        data_utils.raise_if_valid_subsets_unintentionally_ignored(cfg)
    for flag in ("ignore_unused_valid_subsets", "combine_valid_subsets"):
        setattr(cfg.dataset, flag, True)
        data_utils.raise_if_valid_subsets_unintentionally_ignored(cfg)
        setattr(cfg.dataset, flag, False)
    cfg.dataset.valid_subset = "valid,valid1"
    data_utils.raise_if_valid_subsets_unintentionally_ignored(cfg)


# ------------------------------------------------------------------------------ files, binarizer, dictionary


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    lines = [f"w{i % 7} w{i % 3} x{i % 5}" if i % 4 else "" for i in range(40)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path), lines


def test_find_offsets_and_chunker(tmp_path):
    from fairseq.preprocessing.file_chunker_utils import Chunker, find_offsets

    path = tmp_path / "lines.txt"
    path.write_bytes(b"Hello, World\n" * 200)
    offsets = find_offsets(str(path), 20)
    # each 130-byte split point lies on a line start, so the offset is the start of the next line
    assert offsets == [0] + [13 + 130 * i for i in range(1, 20)] + [2600]
    chunks = []
    for start, end in zip(offsets, offsets[1:]):
        with Chunker(str(path), start, end) as lines:
            chunks.append(list(lines))
    assert sum(len(c) for c in chunks) == 200 and all(line == "Hello, World\n" for c in chunks for line in c)
    odd = tmp_path / "odd.txt"
    odd.write_bytes(b"a\x0cb\r\nc\rd")  # \x0c does not end a line; \r\n and \r do (text mode)
    with Chunker(str(odd), 0, -1) as lines:
        assert list(lines) == ["a\x0cb\n", "c\n", "d"]


def test_vocabulary_binarizer_and_file_binarizer(tmp_path, text_file):
    from fairseq.preprocessing.binarizer import BinarizeSummary, FileBinarizer, VocabularyDatasetBinarizer

    path, lines = text_file
    vocab = Dictionary()
    for line in lines:
        for word in line.split():
            if not word.startswith("x"):
                vocab.add_symbol(word)
    vocab.finalize()
    summary = BinarizeSummary()
    ids = VocabularyDatasetBinarizer(vocab).binarize_line("w1 x3 <unk> w2", summary)
    assert ids.tolist() == [vocab.index("w1"), vocab.unk(), vocab.unk(), vocab.index("w2"), vocab.eos()]
    assert (summary.num_seq, summary.num_tok, summary.num_replaced) == (1, 5, 1)  # the literal <unk> is no replacement

    binarizer = VocabularyDatasetBinarizer(vocab, append_eos=False)
    summaries = {}
    for workers in (1, 3):
        prefix = str(tmp_path / f"out{workers}")
        summaries[workers] = FileBinarizer.multiprocess_dataset(
            path, "mmap", binarizer, prefix, vocab_size=len(vocab), num_workers=workers
        )
        ds = MMapIndexedDataset(prefix)
        assert [vocab.string(ds[i]) for i in range(len(ds))] == [
            " ".join(w if not w.startswith("x") else "<unk>" for w in line.split()) for line in lines
        ]
        assert ds.dtype == np.uint16
    assert open(str(tmp_path / "out1.bin"), "rb").read() == open(str(tmp_path / "out3.bin"), "rb").read()
    assert summaries[1].num_seq == summaries[3].num_seq == 40 and summaries[1].num_replaced == 30
    chunk = FileBinarizer._binarize_chunk_and_finalize(
        binarizer,
        path,
        offset_start=0,
        offset_end=-1,
        output_prefix=str(tmp_path / "whole"),
        dataset_impl="mmap",
        vocab_size=len(vocab),
    )
    assert chunk.num_tok == sum(len(line.split()) for line in lines)
    with pytest.raises(ValueError, match="dataset_impl 'lazy'"):
        FileBinarizer.multiprocess_dataset(path, "lazy", binarizer, str(tmp_path / "x"))


def test_add_file_to_dictionary_counts_words_and_line_ends(text_file):
    path, lines = text_file
    counts = collections.Counter(w for line in lines for w in line.split())
    for workers in (1, 2):
        d = Dictionary()
        Dictionary.add_file_to_dictionary(path, d, num_workers=workers)
        assert {s: d.count[d.index(s)] for s in counts} == dict(counts)
        assert d.count[d.eos()] == 1 + len(lines)  # the special's own 1, plus one per line
    upper = Dictionary()
    Dictionary.add_file_to_dictionary(path, upper, tokenize=lambda line: line.upper().split())
    assert "W1" in upper and "w1" not in upper


def test_duplicate_dictionary_entry_is_a_runtime_error(tmp_path):
    path = tmp_path / "dict.txt"
    path.write_text("a 3\nb 2\na 1\n")
    with pytest.raises(RuntimeError, match=r"dict.txt, line 3: duplicate symbol 'a'; append ' #fairseq:overwrite'"):
        Dictionary.load(str(path))
    with pytest.raises(ValueError):  # still a ValueError too: the commands print it as one line
        Dictionary.load(str(path))


def test_task_get_batch_iterator_takes_upstreams_options():
    from types import SimpleNamespace

    from fairseq.tasks import FairseqTask

    class Items(FairseqDataset):
        sizes = np.full(6, 2)

        def __getitem__(self, i):
            return i

        def __len__(self):
            return 6

        def collater(self, samples):
            return samples

    task, ds = FairseqTask(SimpleNamespace()), Items()
    itr = task.get_batch_iterator(ds, max_sentences=2, skip_remainder_batch=True)
    assert len(list(itr.next_epoch_itr(shuffle=False))) == 2  # 3 batches, the last left out
    assert task.get_batch_iterator(ds, max_sentences=2, skip_remainder_batch=True) is itr  # cached
    assert (
        task.get_batch_iterator(ds, max_sentences=2, skip_remainder_batch=True, update_epoch_batch_itr=True) is not itr
    )
    assert task.get_batch_iterator(ds, max_sentences=2, grouped_shuffling=True, num_shards=2).grouped_shuffling
