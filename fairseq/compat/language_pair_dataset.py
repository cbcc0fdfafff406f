"""`LanguagePairDataset` and its `collate`: upstream fairseq's (source, target) pair batches, for plug-ins and
upstream's test helpers that build encoder-decoder batches.

This fork has no translation task (fairseq.upstream_absent); these are the data half of upstream's
encoder-decoder base classes (fairseq.models.FairseqEncoderDecoderModel). A batch is upstream's layout:

    {"id": [B], "nsentences": B, "ntokens": target tokens (source tokens without targets),
     "net_input": {"src_tokens": [B, S], "src_lengths": [B], "prev_output_tokens": [B, T]},
     "target": [B, T] or None}

with rows sorted by descending source length (`id` says which item each row is), the source left-padded and
the target right-padded by default, and `prev_output_tokens` the target with its last token (eos) moved to the
front (teacher forcing: the decoder sees eos, t1, t2, ... and predicts t1, t2, ..., eos). Upstream's word
alignments, lexical constraints and length buckets are not supported.
"""

from typing import Dict, List, Optional

import numpy as np
import torch

from fairseq.data import data_utils
from fairseq.data.fairseq_dataset import FairseqDataset


def _lengths(tensors: List[torch.Tensor], pad_idx: int) -> torch.Tensor:
    return torch.tensor([int(t.ne(pad_idx).sum()) for t in tensors], dtype=torch.long)


def collate(
    samples: List[dict],
    pad_idx: int,
    eos_idx: int,
    left_pad_source: bool = True,
    left_pad_target: bool = False,
    input_feeding: bool = True,
    pad_to_length: Optional[Dict[str, int]] = None,
    pad_to_multiple: int = 1,
) -> dict:
    """Upstream's pair collater over items `{"id", "source", "target"(optional), "prev_output_tokens"(optional)}`.

    `pad_to_length` ({"source": S, "target": T}) sets minimum widths; widths round up to `pad_to_multiple`.
    Lengths and `ntokens` count the non-padding tokens. An empty list gives an empty batch ({}).
    """
    if len(samples) == 0:
        return {}
    pad_to_length = pad_to_length or {}

    def merge(key: str, left_pad: bool, move_eos_to_beginning: bool = False, width_key: Optional[str] = None):
        return data_utils.collate_tokens(
            [s[key] for s in samples],
            pad_idx,
            eos_idx,
            left_pad=left_pad,
            move_eos_to_beginning=move_eos_to_beginning,
            pad_to_length=pad_to_length.get(width_key),
            pad_to_multiple=pad_to_multiple,
        )

    src_lengths, order = _lengths([s["source"] for s in samples], pad_idx).sort(descending=True, stable=True)
    batch = {
        "id": torch.tensor([s["id"] for s in samples], dtype=torch.long).index_select(0, order),
        "nsentences": len(samples),
        "ntokens": int(src_lengths.sum()),
        "net_input": {
            "src_tokens": merge("source", left_pad_source, width_key="source").index_select(0, order),
            "src_lengths": src_lengths,
        },
        "target": None,
    }
    if samples[0].get("target") is not None:
        batch["target"] = merge("target", left_pad_target, width_key="target").index_select(0, order)
        batch["ntokens"] = int(_lengths([s["target"] for s in samples], pad_idx).sum())
        if samples[0].get("prev_output_tokens") is not None:  # given by the dataset: taken as they are
            prev = merge("prev_output_tokens", left_pad_target)
        elif input_feeding:
            prev = merge("target", left_pad_target, move_eos_to_beginning=True, width_key="target")
        else:
            prev = None
        if prev is not None:
            batch["net_input"]["prev_output_tokens"] = prev.index_select(0, order)
    return batch


class LanguagePairDataset(FairseqDataset):
    """Pairs of a source dataset and an optional target dataset of 1-D token tensors (upstream's arguments).

    `src_sizes` / `tgt_sizes` are the items' lengths (for batching and size filters); `shuffle` randomizes the
    order before the stable sort by (source, target) length; `append_eos_to_target` appends the target
    dictionary's eos where it is missing, `append_bos` prepends bos to both sides where missing,
    `remove_eos_from_source` drops a trailing eos from the source; `eos` is the symbol `prev_output_tokens`
    starts with (the source dictionary's eos by default); `src_lang_id` / `tgt_lang_id` add
    `net_input["src_lang_id"]` / `"tgt_lang_id"` ([B, 1]) to every batch.
    """

    def __init__(
        self,
        src,
        src_sizes,
        src_dict,
        tgt=None,
        tgt_sizes=None,
        tgt_dict=None,
        left_pad_source: bool = True,
        left_pad_target: bool = False,
        shuffle: bool = True,
        input_feeding: bool = True,
        remove_eos_from_source: bool = False,
        append_eos_to_target: bool = False,
        append_bos: bool = False,
        eos: Optional[int] = None,
        src_lang_id: Optional[int] = None,
        tgt_lang_id: Optional[int] = None,
        pad_to_multiple: int = 1,
    ):
        if tgt_dict is not None:
            for symbol in ("pad", "eos", "unk"):
                if getattr(src_dict, symbol)() != getattr(tgt_dict, symbol)():
                    raise ValueError(
                        f"LanguagePairDataset: the source and target dictionaries must share the "
                        f"{symbol} index (source {getattr(src_dict, symbol)()}, target "
                        f"{getattr(tgt_dict, symbol)()})"
                    )
        if tgt is not None and len(src) != len(tgt):
            raise ValueError(
                f"LanguagePairDataset: source and target must hold the same number of items "
                f"(source {len(src)}, target {len(tgt)})"
            )
        if (tgt is None) != (tgt_sizes is None):
            raise ValueError("LanguagePairDataset: give tgt and tgt_sizes together (or neither)")
        self.src, self.tgt = src, tgt
        self.src_sizes = np.asarray(src_sizes)
        self.tgt_sizes = np.asarray(tgt_sizes) if tgt_sizes is not None else None
        # Upstream's `sizes`: [N] source lengths, or [N, 2] (source, target) lengths.
        self.sizes = self.src_sizes if self.tgt_sizes is None else np.vstack((self.src_sizes, self.tgt_sizes)).T
        self.src_dict, self.tgt_dict = src_dict, tgt_dict
        self.left_pad_source, self.left_pad_target = left_pad_source, left_pad_target
        self.shuffle, self.input_feeding = shuffle, input_feeding
        self.remove_eos_from_source, self.append_eos_to_target = remove_eos_from_source, append_eos_to_target
        self.append_bos = append_bos
        self.eos = eos if eos is not None else src_dict.eos()
        self.src_lang_id, self.tgt_lang_id = src_lang_id, tgt_lang_id
        self.pad_to_multiple = pad_to_multiple

    def __getitem__(self, index: int) -> dict:
        src_item = self.src[index]
        tgt_item = self.tgt[index] if self.tgt is not None else None
        tgt_dict = self.tgt_dict if self.tgt_dict is not None else self.src_dict
        if (
            tgt_item is not None
            and self.append_eos_to_target
            and (len(tgt_item) == 0 or tgt_item[-1] != tgt_dict.eos())
        ):
            tgt_item = torch.cat([tgt_item, tgt_item.new_tensor([tgt_dict.eos()])])
        if self.append_bos:
            if tgt_item is not None and (len(tgt_item) == 0 or tgt_item[0] != tgt_dict.bos()):
                tgt_item = torch.cat([tgt_item.new_tensor([tgt_dict.bos()]), tgt_item])
            if len(src_item) == 0 or src_item[0] != self.src_dict.bos():
                src_item = torch.cat([src_item.new_tensor([self.src_dict.bos()]), src_item])
        if self.remove_eos_from_source and len(src_item) > 0 and src_item[-1] == self.src_dict.eos():
            src_item = src_item[:-1]
        return {"id": index, "source": src_item, "target": tgt_item}

    def __len__(self) -> int:
        return len(self.src)

    def collater(self, samples: List[dict], pad_to_length: Optional[Dict[str, int]] = None) -> dict:
        batch = collate(
            samples,
            pad_idx=self.src_dict.pad(),
            eos_idx=self.eos,
            left_pad_source=self.left_pad_source,
            left_pad_target=self.left_pad_target,
            input_feeding=self.input_feeding,
            pad_to_length=pad_to_length,
            pad_to_multiple=self.pad_to_multiple,
        )
        if batch:
            src_tokens = batch["net_input"]["src_tokens"]
            rows = src_tokens.size(0)
            if self.src_lang_id is not None:
                batch["net_input"]["src_lang_id"] = src_tokens.new_full((rows, 1), self.src_lang_id)
            if self.tgt_lang_id is not None:
                batch["tgt_lang_id"] = src_tokens.new_full((rows, 1), self.tgt_lang_id)
        return batch

    def num_tokens(self, index: int) -> int:
        """The longer side of the pair: the value --max-tokens limits."""
        return int(max(self.src_sizes[index], self.tgt_sizes[index] if self.tgt_sizes is not None else 0))

    def num_tokens_vec(self, indices) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        sizes = self.src_sizes[indices]
        return sizes if self.tgt_sizes is None else np.maximum(sizes, self.tgt_sizes[indices])

    def size(self, index: int):
        """(source length, target length or 0), as the --max-positions filter compares them."""
        return self.src_sizes[index], self.tgt_sizes[index] if self.tgt_sizes is not None else 0

    def ordered_indices(self) -> np.ndarray:
        """By source length, ties by target length (then the shuffled or original order): stable sorts."""
        indices = np.random.permutation(len(self)) if self.shuffle else np.arange(len(self))
        indices = indices.astype(np.int64)
        if self.tgt_sizes is not None:
            indices = indices[np.argsort(self.tgt_sizes[indices], kind="mergesort")]
        return indices[np.argsort(self.src_sizes[indices], kind="mergesort")]

    def filter_indices_by_size(self, indices, max_sizes):
        """(kept indices in their order, dropped indices as a list): a pair is dropped when its source is longer
        than `max_sizes` (a number, or the first of a (source, target) pair) or its target longer than the
        number (or the second); None is no limit."""
        indices = np.asarray(indices, dtype=np.int64)
        if max_sizes is None:
            return indices, []
        max_src, max_tgt = (max_sizes, max_sizes) if np.isscalar(max_sizes) else tuple(max_sizes)
        too_long = np.zeros(len(indices), dtype=bool)
        if max_src is not None:
            too_long |= self.src_sizes[indices] > max_src
        if max_tgt is not None and self.tgt_sizes is not None:
            too_long |= self.tgt_sizes[indices] > max_tgt
        return indices[~too_long], indices[too_long].tolist()

    @property
    def supports_prefetch(self) -> bool:
        return getattr(self.src, "supports_prefetch", False) and (
            self.tgt is None or getattr(self.tgt, "supports_prefetch", False)
        )

    def prefetch(self, indices) -> None:
        self.src.prefetch(indices)
        if self.tgt is not None:
            self.tgt.prefetch(indices)
