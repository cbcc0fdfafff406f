import os
from collections import Counter

import numpy as np
import pytest

from fairseq import binarizer as upstream_name
from fairseq.data import line_encoder, stream_tokenizer, text_files
from fairseq.preprocessing import binarizer
from fairseq.preprocessing.binarizer import BinarizeSummary, binarize_file, build_dictionary, count_words, find_offsets
from fairseq.data import Dictionary, MMapIndexedDataset

# Line ends of every kind, empty lines, no final newline, Unicode whitespace (NBSP, \x1c), tabs, a literal
# <unk> (not counted as replaced), a literal </s> inside a line, and words missing from the dictionary.
TRICKY = (
    "the cat sat\r\n"
    "\n"
    "on\tthe  mat\rand <unk> then\n"
    "\u00e9t\u00e9\u00a0caf\u00e9 x\x1cy\n"
    "   \n"
    "a </s> b zzz qqq\r"
    "\r\n"
    "last line without newline"
)


def reference_lines(path):
    """What upstream iterates: Python text-mode lines (universal newlines)."""
    with open(path, "r", encoding="utf-8") as f:
        return list(f)


def write(path, text):
    with open(path, "wb") as f:
        f.write(text.encode("utf-8"))
    return str(path)


def make_dict(words):
    d = Dictionary()
    for w in words:
        d.add_symbol(w)
    d.finalize(padding_factor=8)
    return d


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(text_files, "BLOCK_BYTES", 7)  # many blocks, lines longer than a block


def test_find_offsets_start_at_line_beginnings(tmp_path):
    text = "".join(f"line {i} {'x' * (i % 7)}\n" for i in range(50))
    path = write(tmp_path / "f.txt", text)
    data = text.encode()
    for n in (1, 2, 3, 8, 60):
        offsets = find_offsets(path, n)
        assert len(offsets) == n + 1 and offsets[0] == 0 and offsets[-1] == len(data)
        assert offsets == sorted(offsets)
        for off in offsets[1:-1]:
            assert off == len(data) or data[off - 1 : off] == b"\n"


@pytest.mark.parametrize("block", [1, 3, 7, 1 << 20])
def test_text_blocks_end_at_line_ends_and_cover_the_file(tmp_path, block):
    path = write(tmp_path / "t.txt", TRICKY)
    blocks = list(binarizer.iter_text_blocks(path, 0, os.path.getsize(path), block))
    assert "".join(blocks) == "".join(reference_lines(path))
    assert all(b.endswith("\n") for b in blocks[:-1])


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_binarize_matches_upstream_line_by_line_encoding(tmp_path, small_blocks, workers):
    path = write(tmp_path / "t.txt", TRICKY * 5)
    d = make_dict("the cat sat on mat and then a b x y \u00e9t\u00e9 caf\u00e9 last line without newline".split())
    summary = binarize_file(path, d, str(tmp_path / "out"), num_workers=workers)
    lines = reference_lines(path)
    expected = [d.encode_line(line).tolist() for line in lines]
    ds = MMapIndexedDataset(str(tmp_path / "out"))
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert ds.dtype == np.uint16
    # 9 lines per copy, 4 joins ("newlinethe"); zzz, qqq and newlinethe replaced, the literal <unk> not
    assert (summary.num_seq, summary.num_tok, summary.num_replaced) == (len(lines), sum(map(len, expected)), 2 * 5 + 4)
    assert len(lines) == 9 * 5 - 4
    assert sorted(os.listdir(tmp_path)) == ["out.bin", "out.idx", "t.txt"]  # no temporary files left


def test_workers_do_not_change_the_bytes(tmp_path):
    text = "".join(f"w{i % 13} w{i % 5} w{i % 29}{' extra' * (i % 4)}\n" for i in range(3000))
    path = write(tmp_path / "t.txt", text)
    d = build_dictionary([path])
    outputs = []
    for workers in (1, 2, 5):
        prefix = str(tmp_path / f"o{workers}")
        binarize_file(path, d, prefix, num_workers=workers)
        outputs.append((open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()))
    assert outputs[0] == outputs[1] == outputs[2]


def test_null_characters_fall_back_to_line_encoding(tmp_path):
    d = make_dict(["a", "b\x00c", "\x00"])
    indices = dict(d.indices)
    marked = dict(indices, **{"\x00": -1})
    text = "a b\x00c \x00\n\n\x00 a\n"
    ids, sizes, replaced = binarizer.encode_block(text, indices, marked, d.unk(), d.eos(), d.unk_word)
    expected = [d.encode_line(line).tolist() for line in text.splitlines()]
    assert ids.tolist() == sum(expected, []) and sizes.tolist() == [len(e) for e in expected]
    assert replaced == 0


def test_count_words_counts_every_token_and_line(tmp_path, small_blocks):
    path = write(tmp_path / "t.txt", TRICKY * 3)
    expected = Counter(w for line in reference_lines(path) for w in line.split())
    for workers in (1, 2, 4):
        counter, lines = count_words(path, workers)
        assert counter == expected
        assert lines == len(reference_lines(path)) == 9 * 3 - 2


def test_build_dictionary_counts_eos_and_sorts_like_upstream(tmp_path):
    path = write(tmp_path / "t.txt", "b a\nc a b\r\n\na z z\n")
    d = build_dictionary([path], num_workers=2, padding_factor=4)
    assert d.symbols == ["<s>", "<pad>", "</s>", "<unk>", "a", "b", "z", "c"]
    assert d.count == [1, 1, 5, 1, 3, 2, 2, 1]  # </s>: 1 (special) + 4 lines


def test_build_dictionary_threshold_and_nwords(tmp_path):
    path = write(tmp_path / "t.txt", "a a a b b c\n")
    assert build_dictionary([path], threshold=2, padding_factor=1).symbols[4:] == ["a", "b"]
    assert build_dictionary([path], nwords=5, padding_factor=1).symbols[4:] == ["a"]


def test_summary_format_matches_upstream():
    assert str(BinarizeSummary(3, 1000, 0)) == "3 sents, 1000 tokens, 0.0% replaced"
    assert str(BinarizeSummary(3, 1000, 12)) == "3 sents, 1000 tokens, 1.2% replaced"
    assert str(BinarizeSummary(3, 3, 1)) == "3 sents, 3 tokens, 33.3% replaced"
    assert str(BinarizeSummary(1, 1, 1)) == "1 sents, 1 tokens, 1e+02% replaced"
    assert str(BinarizeSummary(0, 0, 0)) == "0 sents, 0 tokens, 0.0% replaced"


def test_empty_file_gives_an_empty_dataset(tmp_path):
    path = write(tmp_path / "e.txt", "")
    summary = binarize_file(path, make_dict([]), str(tmp_path / "e"), num_workers=2)
    assert (summary.num_seq, summary.num_tok) == (0, 0)
    assert len(MMapIndexedDataset(str(tmp_path / "e"))) == 0


def test_invalid_utf8_names_file_and_offset(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"ok line\nbad \xff byte\n")
    with pytest.raises(ValueError, match=r"bad\.txt: invalid UTF-8 at byte 12"):
        count_words(str(path))


def test_failing_worker_leaves_no_files_and_keeps_the_old_dataset(tmp_path):
    good = write(tmp_path / "good.txt", "a b\n" * 100)
    d = make_dict(["a", "b"])
    out = tmp_path / "out"
    out.mkdir()
    binarize_file(good, d, str(out / "train"))
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a b\n" * 100 + b"\xfe\n" + b"a\n" * 10)  # the error is in the second worker's range
    with pytest.raises(ValueError, match=r"bad\.txt: invalid UTF-8 at byte 400"):
        binarize_file(str(bad), d, str(out / "train"), num_workers=2)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


def test_missing_input_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"input file .*nope\.txt does not exist"):
        binarize_file(str(tmp_path / "nope.txt"), make_dict([]), str(tmp_path / "o"))


def test_the_line_encoders_are_one_definition_under_every_name():
    """fairseq-preprocess and the streaming task share the text -> ids step (fairseq.data.line_encoder); the
    binarizer's names for it (and upstream's module name, fairseq.binarizer) are the same objects."""
    names = ["LineEncoder", "GPT2LineEncoder", "SentencepieceLineEncoder", "LocalIdTable", "map_local_ids"]
    names += ["make_line_encoder", "register_line_encoder", "line_encoder_for", "bpe_spec", "encode_block"]
    for name in names:
        assert getattr(binarizer, name) is getattr(line_encoder, name) is getattr(upstream_name, name), name
    assert stream_tokenizer.encode_block is binarizer.encode_block
    assert stream_tokenizer.map_local_ids is binarizer.map_local_ids
