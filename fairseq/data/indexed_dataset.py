"""Upstream fairseq's memory-mapped binarized format (MMIDIDX): `<prefix>.bin` + `<prefix>.idx`.

`.idx`, little-endian: magic `MMIDIDX\\x00\\x00` (9 bytes), version uint64 = 1, dtype code uint8,
item count N uint64, sizes int32[N] (tokens per item), pointers int64[N] (byte offset of each item
in `.bin`). `.bin` holds the items' token ids back to back in that dtype. Both files are read through
numpy memmaps, so opening a dataset costs O(1) memory whatever its size.
"""

import os
import shutil
import struct
import tempfile
from typing import Optional, Union

import numpy as np
import torch

HDR_MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_FORMAT = "<9sQBQ"  # magic, version, dtype code, item count
HEADER_SIZE = struct.calcsize(HEADER_FORMAT)  # 26

# Upstream's codes; 6 and 7 are both float64 (upstream's np.float / np.double), 6 is written for it.
CODE_TO_DTYPE = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float64),
    8: np.dtype(np.uint16),
    9: np.dtype(np.uint32),
    10: np.dtype(np.uint64),
}

# Streaming chunk (items) for index writing and scans: bounded memory on any dataset size.
_CHUNK_ITEMS = 1 << 18
_COPY_BYTES = 1 << 20  # buffer for copying .bin data and spilled sizes


def dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    for code, dt in CODE_TO_DTYPE.items():
        if dt == dtype:
            return code
    raise ValueError(
        f"dtype {dtype} cannot be stored in an MMIDIDX dataset; use one of "
        f"{sorted({str(d) for d in CODE_TO_DTYPE.values()})}"
    )


def best_fitting_dtype(vocab_size) -> np.dtype:
    """The dtype upstream writes for a vocabulary of `vocab_size` ids."""
    if vocab_size is None:
        return np.dtype(np.uint32)
    if vocab_size < 65500:
        return np.dtype(np.uint16)
    if vocab_size < 4294967295:
        return np.dtype(np.uint32)
    return np.dtype(np.int64)


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


LAYOUT_CHECK_WINDOW = 1 << 22  # items per window of MMapIndex._check_layout


class CorruptDatasetError(ValueError):
    """A `.idx`/`.bin` pair that is not a valid MMIDIDX dataset; the message names the file."""


class MMapIndex:
    """The parsed `.idx`: dtype, sizes and pointers as read-only memmapped numpy arrays."""

    def __init__(self, path: str):
        self.path = path
        try:
            file_size = os.path.getsize(path)
            with open(path, "rb") as f:
                header = f.read(HEADER_SIZE)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"dataset index {path} does not exist; run fairseq-preprocess to create it"
            ) from None
        if len(header) < HEADER_SIZE:
            if not HDR_MAGIC.startswith(header[:9]):
                raise CorruptDatasetError(f"{path}: not an MMIDIDX index (wrong magic {header[:9]!r})")
            raise CorruptDatasetError(
                f"{path}: truncated index: {file_size} bytes, shorter than the {HEADER_SIZE}-byte header; "
                "re-run fairseq-preprocess"
            )
        magic, version, code, n = struct.unpack(HEADER_FORMAT, header)
        if magic != HDR_MAGIC:
            raise CorruptDatasetError(
                f"{path}: not an MMIDIDX index (magic {magic!r}, expected {HDR_MAGIC!r}); only the mmap "
                "dataset format is supported: re-binarize with fairseq-preprocess"
            )
        if version != VERSION:
            raise CorruptDatasetError(f"{path}: unknown MMIDIDX version {version} (only version {VERSION} exists)")
        if code not in CODE_TO_DTYPE:
            raise CorruptDatasetError(f"{path}: unknown dtype code {code} (valid codes: 1..10)")
        expected = HEADER_SIZE + n * (4 + 8)
        if file_size != expected:
            raise CorruptDatasetError(
                f"{path}: index holds {file_size} bytes but its header announces {n} items ({expected} bytes): "
                f"the file is {'truncated' if file_size < expected else 'followed by extra bytes'}; "
                "re-run fairseq-preprocess"
            )
        self.dtype = CODE_TO_DTYPE[code]
        self._len = n
        if n:
            buf = np.memmap(path, mode="r", dtype=np.uint8)
            self.sizes = np.frombuffer(buf, dtype=np.int32, count=n, offset=HEADER_SIZE)
            self.pointers = np.frombuffer(buf, dtype=np.int64, count=n, offset=HEADER_SIZE + 4 * n)
        else:  # numpy cannot memmap an empty range
            self.sizes = np.zeros(0, dtype=np.int32)
            self.pointers = np.zeros(0, dtype=np.int64)
        self._check_layout()

    def _check_layout(self) -> None:
        """Each pointer is the previous pointer plus the previous size times the dtype's bytes (upstream's
        layout, the only one fairseq-preprocess writes); checked in windows so a huge index costs no big copy."""
        n, itemsize = self._len, self.dtype.itemsize
        for start in range(0, n, LAYOUT_CHECK_WINDOW):
            stop = min(n, start + LAYOUT_CHECK_WINDOW + 1)
            sizes = self.sizes[start:stop].astype(np.int64)
            pointers = self.pointers[start:stop]
            bad_sizes = np.flatnonzero(sizes < 0)
            bad_ptrs = np.flatnonzero(pointers[1:] != pointers[:-1] + sizes[:-1] * itemsize)
            if bad_sizes.size or bad_ptrs.size:
                i = start + int(min(bad_sizes[:1].tolist() + bad_ptrs[:1].tolist()))
                size, ptr = int(self.sizes[i]), int(self.pointers[i])
                what = (
                    f"item {i} has size {size}"
                    if size < 0
                    else f"item {i} (pointer {ptr}, size {size}) ends at byte {ptr + size * itemsize} but item "
                    f"{i + 1}'s pointer is {int(self.pointers[i + 1])}"
                )
                raise CorruptDatasetError(f"{self.path}: corrupt index: {what}; re-run fairseq-preprocess")

    def __len__(self) -> int:
        return self._len

    def data_nbytes(self) -> int:
        """Bytes the `.bin` must hold according to the last item's pointer and size."""
        if self._len == 0:
            return 0
        return int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize


class MMapIndexedDataset(torch.utils.data.Dataset):
    """Random access to a binarized dataset: `ds[i]` is item i's token ids as an int64 tensor."""

    supports_prefetch = False

    def __init__(self, path: str):
        super().__init__()
        self._path = path
        self._index = MMapIndex(index_file_path(path))
        bin_path = data_file_path(path)
        try:
            bin_size = os.path.getsize(bin_path)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"dataset data file {bin_path} does not exist (its index does); re-run fairseq-preprocess"
            ) from None
        needed = self._index.data_nbytes()
        first_ok = len(self._index) == 0 or self._index.pointers[0] == 0
        if bin_size != needed or not first_ok:
            raise CorruptDatasetError(
                f"{bin_path}: {bin_size} bytes, but the sizes and pointers in {index_file_path(path)} describe "
                f"{needed} bytes of {self._index.dtype}: the two files do not belong together or one is "
                "truncated; re-run fairseq-preprocess"
            )
        self._bin_nbytes = bin_size
        if bin_size:
            self._data = np.memmap(bin_path, mode="r", dtype=self._index.dtype)
        else:
            self._data = np.zeros(0, dtype=self._index.dtype)

    @property
    def path(self) -> str:
        return self._path

    @property
    def dtype(self) -> np.dtype:
        return self._index.dtype

    @property
    def sizes(self) -> np.ndarray:
        return self._index.sizes

    @property
    def pointers(self) -> np.ndarray:
        return self._index.pointers

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i) -> torch.Tensor:
        n = len(self._index)
        if isinstance(i, slice):  # contiguous items: one read
            start, stop, step = i.indices(n)
            if step != 1:
                raise ValueError("MMapIndexedDataset slices must be contiguous (step 1)")
            if start >= stop:
                return torch.zeros(0, dtype=torch.int64)
            begin = int(self._index.pointers[start]) // self.dtype.itemsize
            end = int(self._index.pointers[stop - 1]) // self.dtype.itemsize + int(self._index.sizes[stop - 1])
            return torch.from_numpy(self._data[begin:end].astype(np.int64))
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for dataset {self._path} with {n} items")
        begin = int(self._index.pointers[i]) // self.dtype.itemsize
        return torch.from_numpy(self._data[begin : begin + int(self._index.sizes[i])].astype(np.int64))

    def get_numpy(self, i: int) -> np.ndarray:
        """Item i in its stored dtype (a view into the memmap: no copy)."""
        begin = int(self._index.pointers[i]) // self.dtype.itemsize
        return self._data[begin : begin + int(self._index.sizes[i])]

    @property
    def tokens(self) -> np.ndarray:
        """All items' tokens back to back, in the stored dtype (the memmapped `.bin`: no copy)."""
        return self._data

    def prefetch(self, indices) -> None:
        raise NotImplementedError("MMapIndexedDataset does not need prefetching (supports_prefetch is False)")

    @staticmethod
    def exists(path: str) -> bool:
        return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))


class MMapIndexedDatasetBuilder:
    """Writes `<prefix>.bin` as items arrive; `finalize(idx_path)` writes the index.

    Item sizes are spilled to an anonymous temporary file, so memory stays bounded however many items
    are added.
    """

    def __init__(self, out_file: str, dtype=np.int64):
        self._dtype = np.dtype(dtype)
        self._code = dtype_code(self._dtype)
        self._out_file = out_file
        self._data_file = open(out_file, "wb")
        self._sizes_spill = tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(out_file)))
        self._pending: list = []
        self._num_items = 0
        self._num_tokens = 0

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def add_item(self, tensor: Union[torch.Tensor, np.ndarray, list]) -> None:
        if torch.is_tensor(tensor):
            tensor = tensor.numpy()
        arr = np.asarray(tensor).astype(self._dtype, copy=False).reshape(-1)
        self._data_file.write(arr.tobytes())
        self._pending.append(arr.size)
        self._num_tokens += arr.size
        if len(self._pending) >= _CHUNK_ITEMS:
            self._flush_pending()

    def add_items(self, tokens: np.ndarray, sizes: np.ndarray) -> None:
        """Append many items at once: `tokens` concatenated (already in this dtype), `sizes` per item."""
        if tokens.dtype != self._dtype:
            raise ValueError(f"add_items: tokens are {tokens.dtype}, the builder writes {self._dtype}")
        sizes = np.asarray(sizes, dtype=np.int64)
        if int(sizes.sum()) != tokens.size:
            raise ValueError(f"add_items: sizes sum to {int(sizes.sum())} but {tokens.size} tokens were given")
        self._data_file.write(np.ascontiguousarray(tokens).tobytes())
        self._write_sizes(sizes)
        self._num_tokens += tokens.size

    def merge_file_(self, another_file: str) -> None:
        """Append the items of the dataset at prefix `another_file` (same dtype required)."""
        self.merge_files_(data_file_path(another_file), index_file_path(another_file))

    def merge_files_(self, bin_path: str, idx_path: str) -> None:
        """`merge_file_` for a pair of explicitly named files (e.g. a worker's temporary output)."""
        index = MMapIndex(idx_path)
        if index.dtype != self._dtype:
            raise ValueError(f"cannot merge {idx_path} ({index.dtype}) into {self._out_file} ({self._dtype})")
        bin_size = os.path.getsize(bin_path)
        if bin_size != index.data_nbytes():
            raise CorruptDatasetError(
                f"{bin_path}: {bin_size} bytes, but {idx_path} describes {index.data_nbytes()}; cannot merge it"
            )
        for start in range(0, len(index), _CHUNK_ITEMS):  # plain reads: no memmapped pages stay resident
            count = min(_CHUNK_ITEMS, len(index) - start)
            self._write_sizes(np.fromfile(idx_path, dtype=np.int32, count=count, offset=HEADER_SIZE + 4 * start))
        with open(bin_path, "rb") as f:
            shutil.copyfileobj(f, self._data_file, _COPY_BYTES)
        self._num_tokens += bin_size // self._dtype.itemsize

    def _write_sizes(self, sizes: np.ndarray) -> None:
        self._flush_pending()  # keep the order of items added one by one and in bulk
        self._spill(sizes)

    def _spill(self, sizes: np.ndarray) -> None:
        if sizes.size and (sizes.min() < 0 or sizes.max() > np.iinfo(np.int32).max):
            raise ValueError(f"item sizes must lie in [0, 2**31); got {int(sizes.min())}..{int(sizes.max())}")
        self._sizes_spill.write(np.asarray(sizes, dtype=np.int32).tobytes())
        self._num_items += sizes.size

    def _flush_pending(self) -> None:
        if self._pending:
            sizes = np.asarray(self._pending, dtype=np.int64)
            self._pending = []
            self._spill(sizes)

    def finalize(self, index_file: str) -> None:
        """Close the `.bin` and write the `.idx` (header, sizes, then pointers)."""
        self._flush_pending()
        self._data_file.close()
        itemsize = self._dtype.itemsize
        spill = self._sizes_spill
        with open(index_file, "wb") as out:
            out.write(struct.pack(HEADER_FORMAT, HDR_MAGIC, VERSION, self._code, self._num_items))
            spill.seek(0)
            shutil.copyfileobj(spill, out, _COPY_BYTES)
            spill.seek(0)
            offset = 0
            while True:
                chunk = spill.read(4 * _CHUNK_ITEMS)
                if not chunk:
                    break
                nbytes = np.frombuffer(chunk, dtype=np.int32).astype(np.int64) * itemsize
                ends = np.cumsum(nbytes) + offset
                out.write((ends - nbytes).tobytes())
                offset = int(ends[-1])
        spill.close()

    def close(self) -> None:
        """Abandon the build (closes files without writing an index)."""
        self._data_file.close()
        self._sizes_spill.close()


# ---- upstream's module-level entry points (`impl` is upstream's --dataset-impl; only "mmap" exists here)


def check_dataset_impl(impl: Optional[str], name: str = "--dataset-impl") -> None:
    """Fail unless `impl` is None or "mmap" (upstream's other formats, raw/lazy/cached/fasta/huffman, are absent)."""
    if impl not in (None, "mmap"):
        raise ValueError(f"{name} {impl!r} is not supported: only 'mmap' (MMIDIDX) datasets exist here")


def infer_dataset_impl(path: str) -> Optional[str]:
    """ "mmap" when `path.idx` starts with the MMIDIDX magic, else None (upstream also recognizes its others)."""
    try:
        with open(index_file_path(path), "rb") as f:
            return "mmap" if f.read(len(HDR_MAGIC)) == HDR_MAGIC else None
    except OSError:
        return None


def dataset_exists(path: str, impl: Optional[str] = "mmap") -> bool:
    check_dataset_impl(impl, "impl")
    return MMapIndexedDataset.exists(path)


def make_dataset(path: str, impl: Optional[str] = "mmap", fix_lua_indexing: bool = False, dictionary=None):
    """The dataset at prefix `path`, or None when its files are missing (upstream's signature;
    `fix_lua_indexing` and `dictionary` only concern upstream's absent formats)."""
    check_dataset_impl(impl, "impl")
    return MMapIndexedDataset(path) if MMapIndexedDataset.exists(path) else None


def make_builder(out_file: str, impl: str = "mmap", vocab_size: Optional[int] = None) -> MMapIndexedDatasetBuilder:
    """A builder writing `out_file` (the .bin) with the id dtype fairseq-preprocess picks for `vocab_size`."""
    check_dataset_impl(impl, "impl")
    return MMapIndexedDatasetBuilder(out_file, dtype=best_fitting_dtype(vocab_size))
