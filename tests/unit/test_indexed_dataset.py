import struct

import numpy as np
import pytest
import torch

from fairseq.data import Dictionary, data_utils, indexed_dataset
from fairseq.data.data_utils import collate_tokens, load_indexed_dataset
from fairseq.data.indexed_dataset import (
    CorruptDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
)

MAGIC = b"MMIDIDX\x00\x00"
# dtype code -> struct format character, written out independently of the module under test
CODE_FORMATS = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 6: "d", 7: "d", 8: "H", 9: "I", 10: "Q"}


def write_by_hand(prefix, code, items, version=1, magic=MAGIC):
    """Write an MMIDIDX pair with struct alone, following the format description."""
    fmt = CODE_FORMATS[code] if code in CODE_FORMATS else "B"
    itemsize = struct.calcsize("<" + fmt)
    sizes = [len(it) for it in items]
    pointers, offset = [], 0
    for n in sizes:
        pointers.append(offset)
        offset += n * itemsize
    idx = magic + struct.pack("<Q", version) + struct.pack("<B", code) + struct.pack("<Q", len(items))
    idx += struct.pack(f"<{len(sizes)}i", *sizes) + struct.pack(f"<{len(pointers)}q", *pointers)
    data = b"".join(struct.pack(f"<{len(it)}{fmt}", *it) for it in items)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(idx)
    with open(f"{prefix}.bin", "wb") as f:
        f.write(data)
    return idx, data


def test_builder_writes_the_format_byte_for_byte(tmp_path):
    prefix = str(tmp_path / "ds")
    b = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    b.add_item(torch.tensor([1, 2, 3]))
    b.add_item(torch.tensor([65535, 4]))
    b.finalize(prefix + ".idx")
    expected_idx = (
        b"MMIDIDX\x00\x00" + struct.pack("<QBQ", 1, 8, 2) + struct.pack("<2i", 3, 2) + struct.pack("<2q", 0, 6)
    )
    assert open(prefix + ".idx", "rb").read() == expected_idx
    assert open(prefix + ".bin", "rb").read() == struct.pack("<5H", 1, 2, 3, 65535, 4)


@pytest.mark.parametrize("code", range(1, 11))
def test_every_dtype_code_is_readable(tmp_path, code):
    prefix = str(tmp_path / f"c{code}")
    items = [[1, 2, 3], [], [7], [100, 0]]
    write_by_hand(prefix, code, items)
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 4
    assert ds.sizes.tolist() == [3, 0, 1, 2] and ds.sizes.dtype == np.int32
    for i, item in enumerate(items):
        assert ds[i].dtype == torch.int64
        assert ds[i].tolist() == item


@pytest.mark.parametrize("code", [c for c in range(1, 11) if c != 7])
def test_builder_writes_each_dtype_code(tmp_path, code):
    dtype = indexed_dataset.CODE_TO_DTYPE[code]
    prefix = str(tmp_path / "ds")
    b = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    b.add_item(torch.tensor([5, 6]))
    b.finalize(prefix + ".idx")
    idx, data = write_by_hand(str(tmp_path / "hand"), code, [[5, 6]])
    assert open(prefix + ".idx", "rb").read() == idx
    assert open(prefix + ".bin", "rb").read() == data


def test_float64_is_written_with_code_6(tmp_path):
    b = MMapIndexedDatasetBuilder(str(tmp_path / "f.bin"), dtype=np.float64)
    b.finalize(str(tmp_path / "f.idx"))
    assert open(tmp_path / "f.idx", "rb").read()[17] == 6


def test_best_fitting_dtype_thresholds():
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.uint32
    assert best_fitting_dtype(4294967294) == np.uint32
    assert best_fitting_dtype(4294967295) == np.int64
    assert best_fitting_dtype(None) == np.uint32


def test_round_trip_mixing_single_and_bulk_adds(tmp_path, monkeypatch):
    monkeypatch.setattr(indexed_dataset, "_CHUNK_ITEMS", 3)  # exercise spilling and chunked pointers
    rng = np.random.default_rng(0)
    items = [rng.integers(0, 70000, size=int(rng.integers(0, 20))) for _ in range(25)]
    prefix = str(tmp_path / "rt")
    b = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint32)
    for it in items[:10]:
        b.add_item(torch.from_numpy(it))
    bulk = items[10:20]
    b.add_items(np.concatenate(bulk).astype(np.uint32), np.array([len(x) for x in bulk]))
    for it in items[20:]:
        b.add_item(it)
    b.finalize(prefix + ".idx")
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 25
    for i, it in enumerate(items):
        assert ds[i].tolist() == it.tolist()
    assert ds[-1].tolist() == items[-1].tolist()
    assert ds[2:5].tolist() == np.concatenate(items[2:5]).tolist()
    expected_pointers = np.concatenate([[0], np.cumsum([len(x) for x in items])[:-1]]) * 4
    assert ds.pointers.tolist() == expected_pointers.tolist()
    with pytest.raises(IndexError, match="out of range"):
        ds[25]


def test_merge_file_appends_items_in_order(tmp_path):
    for name, items in (("a", [[1, 2], [3]]), ("b", [[4], [], [5, 6, 7]])):
        b = MMapIndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), dtype=np.uint16)
        for it in items:
            b.add_item(torch.tensor(it))
        b.finalize(str(tmp_path / f"{name}.idx"))
    m = MMapIndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    m.add_item(torch.tensor([9]))
    m.merge_file_(str(tmp_path / "a"))
    m.merge_file_(str(tmp_path / "b"))
    m.finalize(str(tmp_path / "m.idx"))
    _, data = write_by_hand(str(tmp_path / "hand"), 8, [[9], [1, 2], [3], [4], [], [5, 6, 7]])
    assert open(tmp_path / "m.idx", "rb").read() == open(tmp_path / "hand.idx", "rb").read()
    assert open(tmp_path / "m.bin", "rb").read() == data


def test_merge_rejects_another_dtype(tmp_path):
    write_by_hand(str(tmp_path / "i32"), 4, [[1]])
    m = MMapIndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match=r"i32.idx \(int32\) into .*m.bin \(uint16\)"):
        m.merge_file_(str(tmp_path / "i32"))


def test_empty_dataset(tmp_path):
    b = MMapIndexedDatasetBuilder(str(tmp_path / "e.bin"), dtype=np.uint16)
    b.finalize(str(tmp_path / "e.idx"))
    assert open(tmp_path / "e.idx", "rb").read() == MAGIC + struct.pack("<QBQ", 1, 8, 0)
    ds = MMapIndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and ds.sizes.tolist() == []


def test_exists(tmp_path):
    prefix = str(tmp_path / "x")
    assert not MMapIndexedDataset.exists(prefix)
    write_by_hand(prefix, 8, [[1]])
    assert MMapIndexedDataset.exists(prefix)
    (tmp_path / "x.bin").unlink()
    assert not MMapIndexedDataset.exists(prefix)
    assert MMapIndexedDataset.supports_prefetch is False


# ---- corrupt inputs: each error names the file and what is wrong ------------------------------------------
def test_missing_index(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothere\.idx does not exist"):
        MMapIndexedDataset(str(tmp_path / "nothere"))


def test_missing_bin(tmp_path):
    write_by_hand(str(tmp_path / "x"), 8, [[1]])
    (tmp_path / "x.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"x\.bin does not exist"):
        MMapIndexedDataset(str(tmp_path / "x"))


def test_truncated_header(tmp_path):
    idx, _ = write_by_hand(str(tmp_path / "x"), 8, [[1]])
    (tmp_path / "x.idx").write_bytes(idx[:20])
    with pytest.raises(CorruptDatasetError, match=r"x\.idx: truncated index: 20 bytes"):
        MMapIndexedDataset(str(tmp_path / "x"))


def test_truncated_sizes_and_pointers(tmp_path):
    idx, _ = write_by_hand(str(tmp_path / "x"), 8, [[1], [2, 3]])
    (tmp_path / "x.idx").write_bytes(idx[:-5])
    with pytest.raises(CorruptDatasetError, match=r"x\.idx: index holds 45 bytes .* 2 items \(50 bytes\).*truncated"):
        MMapIndexedDataset(str(tmp_path / "x"))


def test_wrong_magic(tmp_path):
    write_by_hand(str(tmp_path / "x"), 8, [[1]], magic=b"TNTIDX\x00\x00\x00")
    with pytest.raises(CorruptDatasetError, match=r"x\.idx: not an MMIDIDX index"):
        MMapIndexedDataset(str(tmp_path / "x"))


def test_short_file_with_wrong_magic(tmp_path):
    (tmp_path / "x.idx").write_bytes(b"hello")
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(CorruptDatasetError, match=r"x\.idx: not an MMIDIDX index"):
        MMapIndexedDataset(str(tmp_path / "x"))


def test_unknown_version(tmp_path):
    write_by_hand(str(tmp_path / "x"), 8, [[1]], version=2)
    with pytest.raises(CorruptDatasetError, match=r"x\.idx: unknown MMIDIDX version 2"):
        MMapIndexedDataset(str(tmp_path / "x"))


@pytest.mark.parametrize("code", [0, 11, 255])
def test_unknown_dtype_code(tmp_path, code):
    write_by_hand(str(tmp_path / "x"), code, [[1]])
    with pytest.raises(CorruptDatasetError, match=rf"x\.idx: unknown dtype code {code}"):
        MMapIndexedDataset(str(tmp_path / "x"))


@pytest.mark.parametrize("delta", [-2, 2])
def test_bin_length_does_not_match_sizes(tmp_path, delta):
    _, data = write_by_hand(str(tmp_path / "x"), 8, [[1, 2], [3]])
    (tmp_path / "x.bin").write_bytes(data + b"\x00" * delta if delta > 0 else data[:delta])
    with pytest.raises(
        CorruptDatasetError, match=r"x\.bin: \d+ bytes, but the sizes and pointers in .*x\.idx describe 6"
    ):
        MMapIndexedDataset(str(tmp_path / "x"))


def test_pointers_inconsistent_with_sizes(tmp_path):
    idx, _ = write_by_hand(str(tmp_path / "x"), 8, [[1, 2], [3]])
    bad = bytearray(idx)
    bad[26 + 8 : 26 + 16] = struct.pack("<q", 2)  # first pointer 2 instead of 0
    (tmp_path / "x.idx").write_bytes(bytes(bad))
    with pytest.raises(
        CorruptDatasetError,
        match=r"x\.idx: corrupt index: item 0 \(pointer 2, size 2\) ends at "
        r"byte 6 but item 1's pointer is 4; re-run fairseq-preprocess",
    ):
        MMapIndexedDataset(str(tmp_path / "x"))


def test_one_size_changed_is_caught(tmp_path):
    """One byte of a size changed (12 -> 5) keeps the .bin's length right; the pointers no longer follow."""
    items = [list(range(4, 16)), [4, 5, 6], [7, 8]]
    idx, _ = write_by_hand(str(tmp_path / "x"), 8, items)
    bad = bytearray(idx)
    assert bad[26] == 12  # item 0's size, right after the 26-byte header
    bad[26] = 5
    (tmp_path / "x.idx").write_bytes(bytes(bad))
    with pytest.raises(
        CorruptDatasetError,
        match=r"^\S*x\.idx: corrupt index: item 0 \(pointer 0, size 5\) ends at "
        r"byte 10 but item 1's pointer is 24; re-run fairseq-preprocess$",
    ):
        MMapIndexedDataset(str(tmp_path / "x"))


def test_layout_is_checked_across_windows(tmp_path, monkeypatch):
    monkeypatch.setattr(indexed_dataset, "LAYOUT_CHECK_WINDOW", 2)
    items = [[4, 5]] * 7
    idx, _ = write_by_hand(str(tmp_path / "x"), 8, items)
    assert len(MMapIndexedDataset(str(tmp_path / "x"))) == 7  # intact: every window passes
    for item in (1, 2, 5):  # inside a window, at a window's last item, at the next window's first
        bad = bytearray(idx)
        bad[26 + 4 * item] = 3
        (tmp_path / "x.idx").write_bytes(bytes(bad))
        with pytest.raises(CorruptDatasetError, match=rf"corrupt index: item {item} \(pointer {4 * item}, size 3\)"):
            MMapIndexedDataset(str(tmp_path / "x"))
    bad = bytearray(idx)
    bad[26 + 4 * 6 : 26 + 4 * 7] = struct.pack("<i", -1)  # the last item: no next pointer to disagree with
    (tmp_path / "x.idx").write_bytes(bytes(bad))
    with pytest.raises(CorruptDatasetError, match=r"corrupt index: item 6 has size -1; re-run fairseq-preprocess"):
        MMapIndexedDataset(str(tmp_path / "x"))


# ---- data_utils ---------------------------------------------------------------------------------------------
def small_dict(n_words):
    d = Dictionary()
    for i in range(n_words):
        d.add_symbol(f"w{i}")
    return d


def test_load_indexed_dataset_returns_none_when_absent(tmp_path):
    assert load_indexed_dataset(str(tmp_path / "train"), small_dict(3)) is None


def test_load_indexed_dataset_checks_the_dictionary(tmp_path):
    write_by_hand(str(tmp_path / "train"), 8, [[4, 5, 2], [6, 2]])
    ds = load_indexed_dataset(str(tmp_path / "train"), small_dict(3))  # ids 0..6 fit 7 entries
    assert ds[1].tolist() == [6, 2]
    with pytest.raises(
        ValueError,
        match=r"dictionary does not match the data: .*train\.bin holds token id 6 .*"
        r"dict\.txt\) has 6 entries",
    ):
        load_indexed_dataset(str(tmp_path / "train"), small_dict(2))


def test_mismatch_error_names_the_loaded_dict_file(tmp_path):
    write_by_hand(str(tmp_path / "train"), 8, [[9, 2]])
    (tmp_path / "my_dict.txt").write_text("a 1\nb 1\n")
    d = Dictionary.load(str(tmp_path / "my_dict.txt"))
    with pytest.raises(ValueError, match=r"holds token id 9 but the dictionary \(.*my_dict\.txt\) has 6 entries"):
        load_indexed_dataset(str(tmp_path / "train"), d)


def test_large_datasets_are_checked_on_spread_windows(tmp_path, monkeypatch):
    monkeypatch.setattr(data_utils, "FULL_SCAN_MAX_TOKENS", 50)
    monkeypatch.setattr(data_utils, "SAMPLE_WINDOWS", 3)
    monkeypatch.setattr(data_utils, "SAMPLE_WINDOW_TOKENS", 10)
    # 100 tokens; windows cover [0, 10), [45, 55), [90, 100)
    for name, bad_at, detected in (("first", 3, True), ("middle", 50, True), ("last", 99, True), ("gap", 20, False)):
        tokens = [4] * 100
        tokens[bad_at] = 50
        write_by_hand(str(tmp_path / name), 8, [tokens[:60], tokens[60:]])
        if detected:
            with pytest.raises(ValueError, match="dictionary does not match the data"):
                load_indexed_dataset(str(tmp_path / name), small_dict(4))
        else:
            assert load_indexed_dataset(str(tmp_path / name), small_dict(4)) is not None


def test_narrow_dtype_needs_no_scan(tmp_path):
    write_by_hand(str(tmp_path / "u8"), 1, [[255]])
    assert load_indexed_dataset(str(tmp_path / "u8"), small_dict(300)) is not None


def test_load_indexed_dataset_rejects_other_impls(tmp_path):
    with pytest.raises(ValueError, match="--dataset-impl 'lazy' is not supported"):
        load_indexed_dataset(str(tmp_path / "x"), None, dataset_impl="lazy")


def test_collate_tokens():
    values = [torch.tensor([5, 6, 2]), torch.tensor([7, 2])]
    assert collate_tokens(values, pad_idx=1).tolist() == [[5, 6, 2], [7, 2, 1]]
    assert collate_tokens(values, pad_idx=1, left_pad=True).tolist() == [[5, 6, 2], [1, 7, 2]]
    assert collate_tokens(values, 1, move_eos_to_beginning=True).tolist() == [[2, 5, 6], [2, 7, 1]]
    assert collate_tokens(values, 1, eos_idx=9, move_eos_to_beginning=True).tolist() == [[9, 5, 6], [9, 7, 1]]
    assert collate_tokens(values, 1, pad_to_multiple=4).tolist() == [[5, 6, 2, 1], [7, 2, 1, 1]]
    assert collate_tokens(values, 1, pad_to_length=4, pad_to_bsz=3).tolist() == [
        [5, 6, 2, 1],
        [7, 2, 1, 1],
        [1, 1, 1, 1],
    ]
