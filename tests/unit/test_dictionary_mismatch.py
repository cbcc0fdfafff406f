"""A dict.txt that does not belong to the binarized data: smaller (an id past it: error), larger across the
uint16 boundary (the dtype proves it: error), larger otherwise (a full scan of the training split shows
entries it never uses: a warning, since a shared --srcdict such as GPT-2's does that legitimately)."""

import logging

import numpy as np
import pytest

from fairseq.data import data_utils
from fairseq.data.data_utils import load_indexed_dataset
from fairseq.data.dictionary import Dictionary
from fairseq.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from tests.train_fixtures import train_in_process

LOGGER = "fairseq.data.data_utils"


def dictionary(n_words, path=None, padding_factor=1):
    d = Dictionary()
    for i in range(n_words):
        d.add_symbol(f"w{i}", n=n_words - i)  # counts fall: ids follow frequency, as finalize orders them
    d.pad_to_multiple_(padding_factor)
    if path is not None:
        d.save(path)
        d = Dictionary.load(path)
    return d


def write_data(prefix, items, vocab_size):
    """A dataset binarized as fairseq-preprocess would for a dictionary of `vocab_size` entries."""
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=best_fitting_dtype(vocab_size))
    for item in items:
        builder.add_item(np.asarray(item))
    builder.finalize(prefix + ".idx")
    return prefix


def test_binarizer_stores_uint16_exactly_below_65500_entries():
    # the rule the dtype check relies on (fairseq-preprocess: binarize_file -> best_fitting_dtype(len(dict)))
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.uint32


def test_uint16_data_with_a_dictionary_of_65500_entries_is_an_error(tmp_path):
    prefix = write_data(str(tmp_path / "train"), [[4, 5, 2], [6, 2]], vocab_size=100)
    big = dictionary(65500 - 4, str(tmp_path / "big_dict.txt"))
    assert len(big) == 65500
    with pytest.raises(ValueError) as err:
        load_indexed_dataset(prefix, big)
    message = str(err.value)
    assert f"{prefix}.bin stores uint16 token ids" in message
    assert "fewer than 65,500 entries" in message and "has 65,500 entries" in message
    assert "big_dict.txt" in message and "fairseq-preprocess --srcdict" in message
    # one entry less fits uint16: no dtype error (and every id is inside the dictionary)
    assert load_indexed_dataset(prefix, dictionary(65499 - 4)) is not None


def test_wider_dtypes_prove_nothing_about_a_small_dictionary(tmp_path):
    # int32 is upstream's dtype for a vocabulary of unknown size and int64 this builder's default
    for dtype in (np.int32, np.int64, np.uint32):
        prefix = str(tmp_path / f"data_{np.dtype(dtype).name}")
        builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        builder.add_item(np.asarray([4, 5, 6, 2]))
        builder.finalize(prefix + ".idx")
        assert load_indexed_dataset(prefix, dictionary(3)) is not None


def test_a_larger_dictionary_warns_for_a_fully_scanned_training_split(tmp_path, caplog):
    prefix = write_data(str(tmp_path / "train"), [[4, 5, 2], [6, 7, 2]], vocab_size=8)  # ids up to 7
    larger = dictionary(20, str(tmp_path / "dict.txt"))  # 24 entries
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert load_indexed_dataset(prefix, larger) is not None  # not a training split: no warning
        assert not caplog.records
        assert load_indexed_dataset(prefix, larger, expect_all_ids=True) is not None
    [record] = caplog.records
    message = record.getMessage()
    assert f"{prefix}.bin uses token ids up to 7 (a dictionary of 8 entries suffices)" in message
    assert f"{tmp_path / 'dict.txt'} has 24 entries, 16 of them used nowhere" in message
    assert f"fairseq-preprocess --srcdict {tmp_path / 'dict.txt'}" in message
    assert "shared dictionary" in message and "\n" not in message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):  # once per file
        load_indexed_dataset(prefix, larger, expect_all_ids=True)
    assert not caplog.records


def test_the_dictionary_the_data_was_built_with_does_not_warn(tmp_path, caplog):
    # fairseq-preprocess pads its dictionary with unused count-0 entries (madeupword0000, ...)
    own = dictionary(5, str(tmp_path / "dict.txt"), padding_factor=8)  # 9 entries -> 16
    assert len(own) == 16 and own[15] == "madeupword0006"
    prefix = write_data(str(tmp_path / "train"), [[4, 8, 2], [5, 6, 7, 2]], vocab_size=len(own))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert load_indexed_dataset(prefix, own, expect_all_ids=True) is not None
    assert not caplog.records


def test_a_sampled_scan_does_not_warn(tmp_path, caplog, monkeypatch):
    # a dataset too large to read in full is checked on windows: its largest id is not known, so no warning
    monkeypatch.setattr(data_utils, "FULL_SCAN_MAX_TOKENS", 4)
    monkeypatch.setattr(data_utils, "SAMPLE_WINDOWS", 2)
    monkeypatch.setattr(data_utils, "SAMPLE_WINDOW_TOKENS", 2)
    prefix = write_data(str(tmp_path / "train"), [[4, 5, 2], [6, 7, 2]], vocab_size=8)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert load_indexed_dataset(prefix, dictionary(20), expect_all_ids=True) is not None
    assert not caplog.records


def test_the_ids_are_scanned_once_per_file(tmp_path, monkeypatch):
    scans = []
    real = data_utils._token_windows
    monkeypatch.setattr(data_utils, "_token_windows", lambda tokens: scans.append(1) or real(tokens))
    prefix = write_data(str(tmp_path / "train"), [[4, 5, 2], [6, 7, 2]], vocab_size=8)
    load_indexed_dataset(prefix, dictionary(4))
    load_indexed_dataset(prefix, dictionary(4), expect_all_ids=True)
    load_indexed_dataset(prefix, dictionary(10), expect_all_ids=True)  # another dictionary: same scan
    with pytest.raises(ValueError, match="holds token id 7"):
        load_indexed_dataset(prefix, dictionary(2))
    assert len(scans) == 1


def test_fairseq_train_warns_about_a_larger_dict_txt(tiny_data, tmp_path):
    """A dict.txt from another preprocessing run, larger than the data's, next to the data."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    own = Dictionary.load(str(data / "dict.txt"))
    for i in range(40):
        own.add_symbol(f"other{i}", n=1)
    own.save(str(data / "dict.txt"))
    argv = [
        "--task",
        "language_modeling",
        str(data),
        "--save-dir",
        str(tmp_path / "ck"),
        "--arch",
        "transformer_lm",
        "--decoder-layers",
        "1",
        "--decoder-embed-dim",
        "16",
        "--decoder-ffn-embed-dim",
        "32",
        "--decoder-attention-heads",
        "2",
        "--optimizer",
        "adam",
        "--lr",
        "0.001",
        "--tokens-per-sample",
        "32",
        "--max-tokens",
        "256",
        "--max-update",
        "1",
        "--cpu",
        "--num-workers",
        "0",
        "--log-file",
        str(tmp_path / "ck" / "train.log"),
    ]
    returncode, _, stderr = train_in_process(argv)
    assert returncode == 0, stderr[-3000:]
    warnings = [
        line
        for line in (tmp_path / "ck" / "train.log").read_text().splitlines()
        if "may not be the one the data was binarized with" in line
    ]
    assert len(warnings) == 1  # the training split only, once
    assert f"{data / 'train.bin'} uses token ids up to 63" in warnings[0]
    assert f"{data / 'dict.txt'} has 104 entries, 40 of them used nowhere" in warnings[0]
