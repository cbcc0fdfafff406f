"""Documents to token ids for `--task streaming_language_modeling`, in worker processes.

Two vocabularies:
- the fork's `--bpe gpt2|sentencepiece` (or none: whitespace words) with `DATA/dict.txt`: ids come from the
  text -> ids step fairseq-preprocess uses (fairseq.data.line_encoder: `encode_block` without --bpe, the line
  encoder and `map_local_ids` with it), so a JSONL corpus gives the ids `fairseq-preprocess --json-key` writes
  for it, and models from both routes share a vocabulary;
- metaseq's `--hf-tokenizer tokenizer.json` or `--vocab-filename/--merges-filename` (GPT-2 byte-level BPE
  files): the tokenizer's ids are the model's; its ids 0-3 must be <s> <pad> </s> <unk> (the Dictionary's).

`TokenizerSpec` is small and picklable; each process builds its encoder once (`_built`).
"""

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
from tokenizers import ByteLevelBPETokenizer, Tokenizer

from fairseq.data.dictionary import Dictionary
from fairseq.data.encoders import BPE_REGISTRY
from fairseq.data.jsonl_corpus import CorpusError, InvalidDocument, parse_document
from fairseq.data.line_encoder import (
    LocalIdTable,
    bpe_spec,
    encode_block,
    line_encoder_for,
    map_local_ids,
    marked_indices,
)

_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # the Dictionary's ids 0-3


@dataclass(frozen=True)
class TokenizerSpec:
    kind: str  # "fairseq" | "hf" | "gpt2_files"
    files: Tuple[str, ...]  # fairseq: (dict.txt,); hf: (tokenizer.json,); gpt2_files: (vocab.json, merges.txt)
    bpe: Optional[tuple] = None  # fairseq: binarizer.bpe_spec of --bpe (None: whitespace words)
    end_of_document: str = "</s>"
    json_key: str = "text"
    skip_invalid: bool = False


def bpe_spec_of(name: str, files: dict) -> tuple:
    """fairseq-preprocess's hashable description (binarizer.bpe_spec) of --bpe `name` with option values `files`
    (the scheme's other options at their defaults)."""
    dc = BPE_REGISTRY.dataclass(name)
    fields = set(getattr(dc, "__dataclass_fields__", {}))
    return (name, bpe_spec(dc(**{k: v for k, v in files.items() if k in fields and v}))[1])


_BUILT = {}


def _built(spec: TokenizerSpec):
    if spec not in _BUILT:
        _BUILT[spec] = _Encoder(spec)
    return _BUILT[spec]


def load_hf_tokenizer(spec: TokenizerSpec):
    for path in spec.files:
        if not os.path.isfile(path):
            flag = "--hf-tokenizer" if spec.kind == "hf" else "--vocab-filename/--merges-filename"
            raise CorpusError(f"{flag} {path}: no such file")
    try:
        if spec.kind == "hf":
            return Tokenizer.from_file(spec.files[0])
        return ByteLevelBPETokenizer.from_file(*spec.files)
    except Exception as e:  # the library's own errors say little about which file; name it
        raise CorpusError(
            f"{', '.join(spec.files)}: not a loadable tokenizer ({str(e).splitlines()[0][:200]})"
        ) from None


def build_dictionary(spec: TokenizerSpec) -> Dictionary:
    """The model's Dictionary for `spec` (dict.txt, or the tokenizer's vocabulary in id order)."""
    if spec.kind == "fairseq":
        path = spec.files[0]
        if not os.path.isfile(path):
            raise CorpusError(
                f"no dictionary {path}: --task streaming_language_modeling with --bpe (or none) reads "
                "DATA/dict.txt (the one fairseq-preprocess wrote, or --srcdict's); or pass "
                "--hf-tokenizer tokenizer.json"
            )
        return Dictionary.load(path)
    tok = load_hf_tokenizer(spec)
    size = tok.get_vocab_size()
    found = tuple(tok.id_to_token(i) for i in range(min(4, size)))
    if found != _SPECIALS:
        raise CorpusError(
            f"{', '.join(spec.files)}: the tokenizer's ids 0-3 are {found}, not {_SPECIALS} (the "
            "model's <s> <pad> </s> <unk>); use a tokenizer with those first, or --bpe with dict.txt"
        )
    d = Dictionary()
    for i in range(4, size):
        d.add_symbol(tok.id_to_token(i) or f"<id{i}>", overwrite=True)
    d.pad_to_multiple_(8)
    return d


class _Encoder:
    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        if spec.kind == "fairseq":
            d = self.dictionary = Dictionary.load(spec.files[0])
            if spec.bpe is None:
                self.marked = marked_indices(d.indices)
            else:
                self.table = LocalIdTable(line_encoder_for(spec.bpe), d.indices, d.unk_index, d.unk_word)
            self.eos, eod = d.eos_index, d.indices.get(spec.end_of_document)
        else:
            self.tok = load_hf_tokenizer(spec)
            self.eos, eod = self.tok.token_to_id("</s>"), self.tok.token_to_id(spec.end_of_document)
        if eod is None:
            raise CorpusError(
                f"--end-of-document-symbol {spec.end_of_document!r} is not in the vocabulary "
                f"({spec.files[0]}); name a symbol it has (default </s>)"
            )
        self.eod = eod

    def encode_lines(self, lines: List[str]) -> Tuple[np.ndarray, np.ndarray]:
        """(ids with </s> after each line, tokens per line) of stripped non-empty lines."""
        if self.spec.kind == "fairseq" and self.spec.bpe is None:
            d = self.dictionary
            ids, sizes, _ = encode_block("\n".join(lines), d.indices, self.marked, d.unk_index, self.eos, d.unk_word)
            return ids, sizes
        if self.spec.kind == "fairseq":
            local, sizes = self.table.encoder.encode(lines)
            if len(sizes) == 0:
                return np.zeros(0, np.int64), np.zeros(0, np.int64)
            ids, out_sizes, _ = map_local_ids(local, sizes, self.table, self.eos)
            return ids, out_sizes
        per_line = [e.ids + [self.eos] for e in self.tok.encode_batch(lines, add_special_tokens=False)]
        sizes = np.fromiter(map(len, per_line), dtype=np.int64, count=len(per_line))
        return np.fromiter((i for ids in per_line for i in ids), dtype=np.int64, count=int(sizes.sum())), sizes


def encode_chunk(spec: TokenizerSpec, raw_lines: List[bytes], path: str, first_lineno: int):
    """One task of the tokenizing workers: the documents on lines first_lineno+1... of `path`.

    Returns (docs, skipped): for each raw line, None (a blank line or an empty document: no items) or
    (ids, item sizes) ending with the end-of-document item; `skipped` lists the messages of invalid lines
    (with `skip_invalid`; otherwise the first one is raised as InvalidDocument)."""
    enc = _built(spec)
    per_doc: List[Optional[List[str]]] = []
    skipped: List[str] = []
    for k, raw in enumerate(raw_lines):
        if not raw.strip():
            per_doc.append(None)
            continue
        try:
            lines = parse_document(raw, spec.json_key, path, first_lineno + k + 1)
        except InvalidDocument as e:
            if not spec.skip_invalid:
                raise
            skipped.append(str(e))
            lines = []
        per_doc.append(lines or None)
    flat = [line for lines in per_doc if lines for line in lines]
    ids, sizes = enc.encode_lines(flat)
    docs, tok_pos, line_pos = [], 0, 0
    for lines in per_doc:
        if not lines:
            docs.append(None)
            continue
        doc_sizes = sizes[line_pos : line_pos + len(lines)]
        n = int(doc_sizes.sum())
        docs.append((np.append(ids[tok_pos : tok_pos + n], enc.eod), np.append(doc_sizes, 1)))
        tok_pos, line_pos = tok_pos + n, line_pos + len(lines)
    return docs, skipped
