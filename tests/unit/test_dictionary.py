import io

import pytest
import torch

from fairseq.data import Dictionary


def dict_from_text(text: str) -> Dictionary:
    return Dictionary.load(io.StringIO(text))


def test_specials_have_upstream_ids():
    d = Dictionary()
    assert (d.bos(), d.pad(), d.eos(), d.unk()) == (0, 1, 2, 3)
    assert d.symbols == ["<s>", "<pad>", "</s>", "<unk>"]
    assert len(d) == 4 and d.nspecial == 4


def test_load_assigns_ids_after_specials_and_splits_on_last_space(tmp_path):
    path = tmp_path / "dict.txt"
    path.write_text("hello 10\nworld 7\na b 3\n", encoding="utf-8")
    d = Dictionary.load(str(path))
    assert d.index("hello") == 4 and d.index("world") == 5 and d.index("a b") == 6
    assert d.count[4:] == [10, 7, 3]
    assert d.index("missing") == d.unk() == 3
    assert d[6] == "a b" and d[999] == "<unk>"
    assert "world" in d and "missing" not in d


def test_duplicate_without_flag_names_file_and_line(tmp_path):
    path = tmp_path / "dict.txt"
    path.write_text("x 2\ny 1\nx 5\n", encoding="utf-8")
    with pytest.raises(ValueError) as e:
        Dictionary.load(str(path))
    assert str(path) in str(e.value) and "line 3" in str(e.value) and "'x'" in str(e.value)


def test_special_symbol_in_file_is_a_duplicate():
    with pytest.raises(ValueError, match="duplicate symbol '<unk>'"):
        dict_from_text("<unk> 4\n")


def test_overwrite_flag_gives_the_later_line_the_symbol():
    d = dict_from_text("x 2\ny 1\nx 5 #fairseq:overwrite\n<s> 9 #fairseq:overwrite\n")
    assert len(d) == 8
    assert d.index("x") == 6 and d.count[6] == 5
    assert d.index("<s>") == 7 and d.bos() == 0  # the bos index itself does not move


@pytest.mark.parametrize("line", ["nocount\n", "tok notanumber\n", "\n", "tok 3 #fairseq:other\n"])
def test_malformed_line_is_an_error_naming_the_line(tmp_path, line):
    path = tmp_path / "bad.txt"
    path.write_text("ok 1\n" + line, encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{path}, line 2: expected '<token> <count>"):
        Dictionary.load(str(path))


def test_save_load_round_trip_is_byte_identical(tmp_path):
    text = "the 100\nof 50\nwith space 3\n\u00e9t\u00e9 2\nmadeupword0000 0\n"
    d = dict_from_text(text)
    out = tmp_path / "sub" / "dict.txt"
    d.save(str(out))
    assert out.read_text(encoding="utf-8") == text
    assert Dictionary.load(str(out)) == d


def test_save_marks_repeated_symbols_so_they_load_back():
    d = dict_from_text("x 2\nx 5 #fairseq:overwrite\n")
    buf = io.StringIO()
    d.save(buf)
    assert buf.getvalue() == "x 2\nx 5 #fairseq:overwrite\n"
    assert dict_from_text(buf.getvalue()).indices == d.indices


def test_finalize_orders_by_count_then_symbol_and_pads():
    d = Dictionary()
    for word in "b b a a c d d d z".split():
        d.add_symbol(word)
    d.finalize()
    assert d.symbols == [
        "<s>",
        "<pad>",
        "</s>",
        "<unk>",
        "d",
        "a",
        "b",
        "c",
        "z",
        "madeupword0000",
        "madeupword0001",
        "madeupword0002",
        "madeupword0003",
        "madeupword0004",
        "madeupword0005",
        "madeupword0006",
    ]
    assert d.count[4:] == [3, 2, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert len(d) == 16 and d.index("madeupword0003") == 12


def test_finalize_ties_sort_by_code_point_not_insertion_order():
    d = Dictionary()
    for word in ["\u00e9", "Z", "a", "_", "A"]:
        d.add_symbol(word, n=4)
    d.finalize(padding_factor=1)
    assert d.symbols[4:] == ["A", "Z", "_", "a", "\u00e9"]


def test_finalize_keeps_specials_in_place_even_when_counted():
    d = Dictionary()
    d.add_symbol("w", 5)
    d.add_symbol("</s>", 100)
    d.finalize(padding_factor=1)
    assert d.symbols == ["<s>", "<pad>", "</s>", "<unk>", "w"]


def test_finalize_threshold_and_nwords():
    d = Dictionary()
    for word, n in [("a", 5), ("b", 4), ("c", 3), ("d", 2), ("e", 1)]:
        d.add_symbol(word, n)
    t = Dictionary()
    t.update(d)
    t.finalize(threshold=3, padding_factor=1)
    assert t.symbols[4:] == ["a", "b", "c"]  # count >= threshold is kept
    n = Dictionary()
    n.update(d)
    n.finalize(nwords=6, padding_factor=4)  # nwords counts the 4 specials
    assert n.symbols[4:] == ["a", "b", "madeupword0000", "madeupword0001"]


def test_finalize_padding_factor_one_adds_nothing():
    d = Dictionary()
    d.add_symbol("x")
    d.finalize(padding_factor=1)
    assert len(d) == 5


def test_encode_line_splits_whitespace_appends_eos_and_maps_unknowns():
    d = dict_from_text("hello 3\nworld 2\n")
    ids = d.encode_line("  hello\tworld \u00a0nope\n")
    assert ids.dtype == torch.int32
    assert ids.tolist() == [4, 5, 3, 2]
    assert d.encode_line("hello", append_eos=False).tolist() == [4]
    assert d.encode_line("").tolist() == [2]
    seen = []
    d.encode_line("world nope", consumer=lambda w, i: seen.append((w, i)))
    assert seen == [("world", 5), ("nope", 3)]
    assert len(d) == 6  # encoding never grows the dictionary by default


def test_encode_line_add_if_not_exist_grows_the_dictionary():
    d = Dictionary()
    assert d.encode_line("x y x", add_if_not_exist=True).tolist() == [4, 5, 4, 2]
    assert d.count[4:] == [2, 1]


def test_string_drops_bos_and_eos_and_renders_unk():
    d = dict_from_text("hello 3\nwor@@ 2\nld 1\n")
    t = torch.tensor([0, 4, 3, 5, 6, 2])
    assert d.string(t) == "hello <unk> wor@@ ld"
    assert d.string(t, escape_unk=True) == "hello <<unk>> wor@@ ld"
    assert d.string(t, bpe_symbol="@@ ") == "hello <unk> world"
    assert d.string(t, include_eos=True) == "hello <unk> wor@@ ld </s>"
    assert d.string(t, unk_string="UNK", extra_symbols_to_ignore=[4]) == "UNK wor@@ ld"
    assert d.string(torch.tensor([[4, 2], [6, 2]])) == "hello\nld"
    assert d.string([4, 6]) == "hello ld"


def test_equality_and_update():
    a = dict_from_text("x 1\ny 2\n")
    b = dict_from_text("x 1\ny 2\n")
    assert a == b
    c = dict_from_text("y 2\nx 1\n")
    assert a != c
    a.update(dict_from_text("y 3\nz 4\n"))
    assert a.symbols[4:] == ["x", "y", "z"] and a.count[4:] == [1, 5, 4]


def test_add_counts_matches_adding_one_by_one():
    from collections import Counter

    words = "q w e q w q".split()
    a = Dictionary()
    a.add_counts(Counter(words))
    assert a.symbols[4:] == ["e", "q", "w"] and a.count[4:] == [1, 3, 2]


def test_index_rejects_non_strings():
    with pytest.raises(TypeError, match="expects a str"):
        Dictionary().index(4)
