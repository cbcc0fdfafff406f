"""Upstream's binarizer classes (`fairseq.preprocessing.binarizer.FileBinarizer`, `VocabularyDatasetBinarizer`, ...), for
scripts that binarize text through them. A `Binarizer` turns one line into a tensor of ids;
`FileBinarizer.multiprocess_dataset` runs one over a file's byte ranges in worker processes and writes an
MMIDIDX dataset, with fairseq-preprocess's own machinery (`fairseq.preprocessing.binarizer`: the same offsets, the same
atomic `.bin`/`.idx` writing). fairseq-preprocess itself uses the faster block encoder there.
"""

from abc import ABC, abstractmethod
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from fairseq.data.dictionary import tokenize_line
from fairseq.data.indexed_dataset import (
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    check_dataset_impl,
    data_file_path,
)
from fairseq.data.text_files import find_offsets
from fairseq.preprocessing.binarizer_jobs import BinarizeSummary, run_jobs_atomically
from fairseq.preprocessing.file_chunker_utils import Chunker


class Binarizer(ABC):
    """How one line of text becomes a tensor; `binarize_line` also counts into the summary."""

    @abstractmethod
    def binarize_line(self, line: str, summary: BinarizeSummary) -> torch.IntTensor: ...


class VocabularyDatasetBinarizer(Binarizer):
    """Ids of a line's tokens in a Dictionary (`encode_line`): unknown words become <unk> (counted as
    replaced), `</s>` is appended unless `append_eos` is False; `already_numberized` lines hold the ids."""

    def __init__(
        self,
        dict,
        tokenize: Callable[[str], List[str]] = tokenize_line,
        append_eos: bool = True,
        reverse_order: bool = False,
        already_numberized: bool = False,
    ):
        self.dict = dict
        self.tokenize = tokenize
        self.append_eos = append_eos
        self.reverse_order = reverse_order
        self.already_numberized = already_numberized

    def binarize_line(self, line: str, summary: BinarizeSummary) -> torch.IntTensor:
        if self.already_numberized:
            ids = [int(token) for token in line.strip().split()]
            if self.reverse_order:
                ids.reverse()
            if self.append_eos:
                ids.append(self.dict.eos())
            tensor = torch.IntTensor(ids)
        else:
            replaced = []

            def count_replaced(word, idx):
                if idx == self.dict.unk_index and word != self.dict.unk_word:
                    replaced.append(word)

            tensor = self.dict.encode_line(
                line,
                line_tokenizer=self.tokenize,
                add_if_not_exist=False,
                consumer=count_replaced,
                append_eos=self.append_eos,
                reverse_order=self.reverse_order,
            )
            summary.num_replaced += len(replaced)
        summary.num_seq += 1
        summary.num_tok += len(tensor)
        return tensor


class AlignmentDatasetBinarizer(Binarizer):
    """`alignment_parser(line)` -> tensor, counted."""

    def __init__(self, alignment_parser: Callable[[str], torch.IntTensor]):
        self.alignment_parser = alignment_parser

    def binarize_line(self, line: str, summary: BinarizeSummary) -> torch.IntTensor:
        ids = self.alignment_parser(line)
        summary.num_seq += 1
        summary.num_tok += len(ids)
        return ids


def _binarize_range(builder, binarizer: Binarizer, path: str, start: int, end: int) -> BinarizeSummary:
    summary = BinarizeSummary()
    with Chunker(path, start, end) as lines:
        for line in lines:
            builder.add_item(binarizer.binarize_line(line, summary))
    return summary


class FileBinarizer:
    """Binarize a text file with a `Binarizer` into `output_prefix.bin/.idx` (upstream's class methods)."""

    @classmethod
    def multiprocess_dataset(
        cls,
        input_file: str,
        dataset_impl: str,
        binarizer: Binarizer,
        output_prefix: str,
        vocab_size: Optional[int] = None,
        num_workers: int = 1,
    ) -> BinarizeSummary:
        """The whole file, split among `num_workers` processes; the output does not depend on their number.
        The id dtype fits `vocab_size` as fairseq-preprocess chooses it (int32 without one)."""
        _check_impl(dataset_impl)
        offsets = find_offsets(input_file, max(1, num_workers))
        jobs = [(_binarize_range, (binarizer, input_file, s, e)) for s, e in zip(offsets, offsets[1:])]
        return run_jobs_atomically(output_prefix, _numpy_dtype(vocab_size), jobs, None)

    @staticmethod
    def _binarize_file_chunk(
        binarizer: Binarizer,
        filename: str,
        offset_start: int,
        offset_end: int,
        output_prefix: str,
        dataset_impl: str,
        vocab_size: Optional[int] = None,
    ) -> Tuple[MMapIndexedDatasetBuilder, BinarizeSummary]:
        """(open builder of `output_prefix.bin`, summary) for one byte range (`offset_end` <= 0: to the end);
        the caller finalizes the builder (after merging other parts into it, for instance)."""
        _check_impl(dataset_impl)
        builder = MMapIndexedDatasetBuilder(data_file_path(output_prefix), dtype=_numpy_dtype(vocab_size))
        return builder, _binarize_range(builder, binarizer, filename, offset_start, offset_end)

    @classmethod
    def _binarize_chunk_and_finalize(
        cls,
        binarizer: Binarizer,
        filename: str,
        offset_start: int,
        offset_end: int,
        output_prefix: str,
        dataset_impl: str,
        vocab_size: Optional[int] = None,
    ) -> BinarizeSummary:
        builder, summary = cls._binarize_file_chunk(
            binarizer, filename, offset_start, offset_end, output_prefix, dataset_impl, vocab_size=vocab_size
        )
        builder.finalize(output_prefix + ".idx")
        return summary


def _numpy_dtype(vocab_size: Optional[int]):
    return best_fitting_dtype(vocab_size) if vocab_size is not None else np.dtype(np.int32)


def _check_impl(dataset_impl: Optional[str]) -> None:
    check_dataset_impl(dataset_impl, "dataset_impl")
