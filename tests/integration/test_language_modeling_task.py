"""language_modeling and dummy_lm end to end: binarized data on disk (real Dictionary and builder), flags
parsed by the real parser, blocks, batches and resumable iteration."""

import os

import numpy as np
import pytest
import torch

from fairseq import options, tasks
from fairseq.data import Dictionary
from fairseq.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype

WORDS = "the cat sat on a mat and dog ran far".split()


def write_split(directory, split, dictionary, lines):
    prefix = os.path.join(directory, split)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=best_fitting_dtype(len(dictionary)))
    for line in lines:
        builder.add_item(dictionary.encode_line(line))
    builder.finalize(prefix + ".idx")


def make_data_dir(directory, lines, valid_lines=None):
    os.makedirs(directory, exist_ok=True)
    dictionary = Dictionary()
    for word in WORDS:
        dictionary.add_symbol(word)
    dictionary.save(os.path.join(directory, "dict.txt"))
    write_split(directory, "train", dictionary, lines)
    if valid_lines is not None:
        write_split(directory, "valid", dictionary, valid_lines)
    return dictionary


TRAIN = ["the cat sat", "on a mat", "and the dog ran far", "", "the dog sat on the mat", "a cat ran"]


def setup(data, *flags):
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [data, "--task", "language_modeling", *flags])
    cfg = options.convert_namespace_to_config(args)
    return tasks.setup_task(cfg.task), cfg


@pytest.fixture()
def data_dir(tmp_path):
    dictionary = make_data_dir(str(tmp_path / "bin"), TRAIN, valid_lines=["a dog sat", "the end"])
    return str(tmp_path / "bin"), dictionary


def stream(dictionary, lines):
    return torch.cat([dictionary.encode_line(line) for line in lines]).tolist()


def test_none_mode_targets_are_the_stream_and_sources_shift_it_by_one(data_dir):
    data, dictionary = data_dir
    task, _ = setup(data, "--tokens-per-sample", "5")
    dataset = task.load_dataset("train")
    tokens = stream(dictionary, TRAIN)  # 26 tokens: 5 blocks of 5 and the last one
    assert len(tokens) == 26 and dataset.sizes.tolist() == [5, 5, 5, 5, 5, 1]
    items = [dataset[i] for i in range(len(dataset))]
    assert sum((item["target"].tolist() for item in items), []) == tokens
    for i, item in enumerate(items):
        previous = dictionary.eos() if i == 0 else tokens[5 * i - 1]
        assert item["source"].tolist() == [previous] + item["target"][:-1].tolist()
        assert item["id"] == i


def test_batches_have_the_upstream_format_and_resume_exactly(data_dir):
    data, dictionary = data_dir
    task, cfg = setup(
        data, "--tokens-per-sample", "4", "--sample-break-mode", "complete", "--max-tokens", "8", "--seed", "3"
    )
    dataset = task.load_dataset("train")
    # Whole sentences of at most 4 tokens: "the cat sat </s>" | "on a mat </s>" | 6 tokens alone | "</s>" |
    # 7 tokens alone | "a cat ran </s>".
    assert dataset.sizes.tolist() == [4, 4, 6, 1, 7, 4]
    epoch_itr = task.get_batch_iterator(
        dataset,
        max_tokens=cfg.dataset.max_tokens,
        seed=cfg.common.seed,
        required_batch_size_multiple=1,
        ignore_invalid_inputs=False,
    )
    assert task.get_batch_iterator(dataset, max_tokens=8, seed=3) is epoch_itr  # cached
    samples = list(epoch_itr.next_epoch_itr(shuffle=True))
    # Ordered by size: block 3 (1 token), the three 4-token blocks (ties in seed order), 6, 7; at most 8
    # tokens (count * longest): [3, x] [y, z] [2] [4].
    assert sorted(len(s["id"]) for s in samples) == [1, 1, 2, 2]
    for sample in samples:
        batch_size, width = sample["net_input"]["src_tokens"].shape
        assert sample["nsentences"] == batch_size == len(sample["id"])
        assert sample["target"].shape == (batch_size, width)
        lengths = sample["net_input"]["src_lengths"]
        assert lengths.tolist() == [int(dataset.sizes[i]) for i in sample["id"]]
        assert sample["ntokens"] == int(lengths.sum()) == int(sample["target"].ne(dictionary.pad()).sum())
        for row, length in enumerate(lengths.tolist()):
            assert sample["net_input"]["src_tokens"][row, length:].eq(dictionary.pad()).all()
            assert sample["net_input"]["src_tokens"][row, 0] == dictionary.eos()
    seen = sorted(i for s in samples for i in s["id"].tolist())
    assert seen == list(range(6))

    # Resume after two batches of epoch 2 in a fresh task: the remaining batches are the same.
    epoch2 = [s["id"].tolist() for s in epoch_itr.next_epoch_itr()]
    restart = task.get_batch_iterator(dataset, max_tokens=8, seed=3, disable_iterator_cache=True)
    itr = restart.next_epoch_itr()
    list(itr)
    itr = restart.next_epoch_itr()
    next(itr), next(itr)
    state = restart.state_dict()
    task2, _ = setup(data, "--tokens-per-sample", "4", "--sample-break-mode", "complete")
    resumed = task2.get_batch_iterator(task2.load_dataset("train"), max_tokens=8, seed=3)
    resumed.load_state_dict(state)
    assert [s["id"].tolist() for s in resumed.next_epoch_itr()] == epoch2[2:]


def test_too_long_blocks_fail_or_are_skipped(data_dir):
    data, _ = data_dir
    task, _ = setup(data, "--tokens-per-sample", "4", "--sample-break-mode", "eos")
    dataset = task.load_dataset("train")
    with pytest.raises(ValueError, match="has 7 tokens, more than --max-tokens 6"):
        task.get_batch_iterator(dataset, max_tokens=6)
    itr = task.get_batch_iterator(dataset, max_tokens=6, ignore_invalid_inputs=True)
    ids = sorted(i for s in itr.next_epoch_itr() for i in s["id"].tolist())
    assert ids == [0, 1, 2, 3, 5]  # block 4 (7 tokens) dropped
    with pytest.raises(ValueError, match="more than --tokens-per-sample / --max-target-positions 5"):
        task.get_batch_iterator(dataset, max_tokens=100, max_positions=5)


def test_add_bos_token_and_output_dictionary_size(data_dir):
    data, dictionary = data_dir
    task, _ = setup(
        data,
        "--tokens-per-sample",
        "4",
        "--sample-break-mode",
        "eos",
        "--add-bos-token",
        "--output-dictionary-size",
        "6",
    )
    item = task.load_dataset("train")[0]  # "the cat sat </s>": ids 4 5 6 2
    bos, eos, unk = dictionary.bos(), dictionary.eos(), dictionary.unk()
    assert item["source"].tolist() == [bos, eos, 4, 5, 6]
    assert item["target"].tolist() == [bos, 4, 5, unk, eos]  # id 6 is past the 6-symbol output dictionary
    assert len(task.target_dictionary) == 6 and len(task.source_dictionary) == len(dictionary)


def test_valid_split_and_truncation(data_dir):
    data, dictionary = data_dir
    task, _ = setup(
        data,
        "--tokens-per-sample",
        "2",
        "--sample-break-mode",
        "eos",
        "--shorten-method",
        "truncate",
        "--shorten-data-split-list",
        "valid",
    )
    valid = task.load_dataset("valid")
    # "a dog sat </s>" and "the end </s>" ("end" is unknown) cut to 2 tokens
    expected = [[dictionary.index("a"), dictionary.index("dog")], [dictionary.index("the"), dictionary.unk()]]
    assert [valid[i]["target"].tolist() for i in range(2)] == expected
    assert task.load_dataset("train").sizes.tolist() == [4, 4, 6, 1, 7, 4]  # train is not shortened
    assert task.dataset("valid") is valid


def test_shards_are_visited_in_turn_by_epoch(tmp_path):
    first = str(tmp_path / "shard1")
    second = str(tmp_path / "shard2")
    make_data_dir(first, ["the cat sat"])
    make_data_dir(second, ["a dog ran far", "on a mat"])
    task, _ = setup(f"{first}:{second}", "--tokens-per-sample", "100", "--sample-break-mode", "eos")
    counts = [len(task.load_dataset("train", epoch=epoch)) for epoch in (1, 2, 3, 4)]
    assert counts == [1, 2, 1, 2]


def test_missing_dictionary_split_and_data_are_clear_errors(tmp_path, data_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"no dict.txt in {empty}; run fairseq-preprocess first"):
        setup(str(empty))
    data, _ = data_dir
    task, _ = setup(data)
    with pytest.raises(FileNotFoundError, match=r"Dataset not found: test \(" + os.path.join(data, "test")):
        task.load_dataset("test")
    with pytest.raises(KeyError, match="'test' is not loaded"):
        task.dataset("test")
    with pytest.raises(ValueError, match="needs a data directory"):
        setup("")
    with pytest.raises(ValueError, match="--self-target and --past-target are not supported"):
        setup(data, "--past-target")


def test_dictionary_that_does_not_match_the_data(tmp_path):
    data = str(tmp_path / "bin")
    make_data_dir(data, TRAIN)
    small = Dictionary()
    small.add_symbol("the")
    small.save(os.path.join(data, "dict.txt"))  # 5 symbols, but the data holds ids up to 13
    task, _ = setup(data)
    with pytest.raises(ValueError, match="dictionary does not match the data"):
        task.load_dataset("train")


def test_dummy_lm_serves_next_token_batches():
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        [
            "--task",
            "dummy_lm",
            "--dict-size",
            "100",
            "--dataset-size",
            "40",
            "--tokens-per-sample",
            "16",
            "--batch-size",
            "8",
            "--seed",
            "2",
        ],
    )
    cfg = options.convert_namespace_to_config(args)
    task = tasks.setup_task(cfg.task)
    assert len(task.dictionary) == 104  # 4 specials + 100 words, already a multiple of 8
    dataset = task.load_dataset("train")
    epoch_itr = task.get_batch_iterator(dataset, max_sentences=cfg.dataset.batch_size, seed=2)
    samples = list(epoch_itr.next_epoch_itr())
    assert len(samples) == 5 and all(s["net_input"]["src_tokens"].shape == (8, 16) for s in samples)
    successor = {}
    for sample in samples:
        src, tgt = sample["net_input"]["src_tokens"], sample["target"]
        assert torch.equal(src[:, 1:], tgt[:, :-1])  # the target is the next token
        assert sample["ntokens"] == 8 * 16 and int(src.min()) >= 4 and int(src.max()) < 104
        for a, b in zip(src.flatten().tolist(), tgt.flatten().tolist()):
            assert successor.setdefault(a, b) == b  # every word has one successor: the loss can fall
    again = tasks.setup_task(cfg.task).load_dataset("train")
    assert torch.equal(again[7]["source"], dataset[7]["source"])
    assert not torch.equal(dataset[7]["source"], dataset[8]["source"])


def test_dummy_lm_default_dictionary_matches_upstream_size():
    from fairseq.tasks.dummy_lm import DummyLMConfig, DummyLMTask

    task = DummyLMTask.setup_task(DummyLMConfig())
    assert len(task.dictionary) == 50000
    assert task.max_positions() == 512
    with pytest.raises(ValueError, match="set --max-tokens or --batch-size"):
        task.get_batch_iterator(task.load_dataset("valid"))
    assert np.asarray(task.dataset("valid").sizes).shape == (100000,)
