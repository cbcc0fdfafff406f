"""A transformers tokenizer that gives fairseq dictionary ids, for the exported model (see docs/export_hf.md).

fairseq encodes text in two steps: the BPE (`--bpe gpt2`: text -> GPT-2 ids, written as numbers;
`--bpe sentencepiece`: text -> pieces), then the dictionary (dict.txt: each number or piece -> its line's id,
<unk> when absent). A `tokenizers` model maps a token to one id and its BPE merges are keyed by ids, so the
remap is done in the vocabulary itself: every token the BPE can output gets the fairseq id of its dict.txt
entry, the merges (strings) stay as they are. This is exact only when every token the BPE can output has a
dict.txt entry: a missing one would need the id <unk> next to others (which breaks the merges), so such a
dictionary is refused (with GPT-2's own dict.txt, which lists all 50257 ids, nothing is missing).

The other dict.txt entries (<s> <pad> </s> <unk>, madeupword padding, ids the BPE never outputs) are in the
vocabulary too, so every id decodes; the four specials and the padding are special tokens, which the
tokenizer does not look for in the text (`split_special_tokens`: a literal "</s>" is encoded as text, as
fairseq does). Encoding adds the token every training sequence began with: </s> (<s> with --add-bos-token).
"""

from typing import Dict, List, Optional

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from fairseq.checkpoint.vocabulary import resolve_bpe
from fairseq.data.dictionary import Dictionary
from fairseq.data.encoders.gpt2_bpe_utils import (
    bytes_to_unicode,
    load_encoder_json,
    load_vocab_bpe,
    merge_order_is_safe,
    producible_tokens,
)
from fairseq.export.hf_sentencepiece import sentencepiece_tokenizer
from fairseq.export.hf_vocab import missing_error, special_symbols

BPE_SCHEMES = ("gpt2", "sentencepiece")


def export_bpe(bpe: Optional[dict], src) -> Optional[dict]:
    """The BPE to build the tokenizer from: `bpe` (the command line's), else the checkpoint's saved --bpe with
    the files it carries (fairseq.checkpoint.vocabulary.resolve_bpe); None when neither names one. Raises
    ValueError / FileNotFoundError naming the flag to fix."""
    saved = src.saved_cfg.get("bpe") if isinstance(src.saved_cfg, dict) else None
    name = (bpe or saved or {}).get("_name")
    if name is None:
        return None
    if name not in BPE_SCHEMES:
        source = "--bpe" if bpe is not None else "the checkpoint's --bpe"
        raise ValueError(
            f"{source} {name}: a transformers tokenizer is written for --bpe gpt2 or sentencepiece "
            "only; pass --no-tokenizer to export the model alone"
        )
    return resolve_bpe(bpe, saved, src.vocabulary, src.path)


def build_hf_tokenizer(bpe_cfg: dict, src):
    """The PreTrainedTokenizerFast for `src` (a fairseq.export.hf.Source) and the BPE `bpe_cfg`."""
    return wrap(
        bpe_tokenizer(bpe_cfg, src.dictionary, src.begin_token),
        src.dictionary,
        src.begin_token,
        src.cfg.max_target_positions,
    )


def bpe_tokenizer(bpe_cfg: dict, dictionary: Dictionary, begin_token: int):
    """The `tokenizers.Tokenizer` giving `dictionary` ids for the text `bpe_cfg`'s BPE encodes."""
    if bpe_cfg["_name"] == "gpt2":
        tokenizer, specials = gpt2_tokenizer(bpe_cfg["gpt2_encoder_json"], bpe_cfg["gpt2_vocab_bpe"], dictionary)
    else:
        tokenizer, specials = sentencepiece_tokenizer(bpe_cfg["sentencepiece_model"], dictionary)
    _finish(tokenizer, dictionary, specials, begin_token)
    return tokenizer


def wrap(tokenizer, dictionary: Dictionary, begin_token: int, max_positions: int):
    from transformers import PreTrainedTokenizerFast  # deferred: optional (the export extra)

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=dictionary[begin_token],
        eos_token=dictionary[dictionary.eos()],
        unk_token=dictionary[dictionary.unk()],
        pad_token=dictionary[dictionary.pad()],
        model_max_length=max_positions,
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )
    # transformers 5 names its class TokenizersBackend; this name loads in 4.x and 5.x alike.
    hf.init_kwargs["tokenizer_class"] = "PreTrainedTokenizerFast"
    return hf


def _finish(tokenizer, dictionary: Dictionary, specials: List[str], begin_token: int) -> None:
    # Already in the model's vocabulary at their dictionary ids: registering them keeps those ids.
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tokenizer.encode_special_tokens = True
    begin, eos = dictionary[begin_token], dictionary[dictionary.eos()]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{begin} $A",
        pair=f"{begin} $A {eos} $B",
        special_tokens=sorted({(begin, begin_token), (eos, dictionary.eos())}, key=lambda t: t[1]),
    )


# ------------------------------------------------------------------------------------------------ GPT-2


def gpt2_tokenizer(encoder_json: str, vocab_bpe: str, dictionary: Dictionary):
    """(tokenizers.Tokenizer, special symbols) for GPT-2's byte-level BPE with dictionary ids.

    The BPE can output the 256 byte symbols and the merge results that `producible_tokens` finds; each is
    given the id of its GPT-2 id's dict.txt entry. Merges keep their rank order (a pair listed twice keeps
    its last rank, as upstream)."""
    encoder = load_encoder_json(encoder_json)
    ranks = {tuple(m): r for r, m in enumerate(load_vocab_bpe(vocab_bpe))}
    merges = sorted(ranks, key=ranks.__getitem__)
    if not merge_order_is_safe(merges):
        raise ValueError(
            f"{vocab_bpe}: some merge uses a token before a merge that produces it; fairseq encodes "
            "this vocabulary with its Python BPE loop, which transformers' BPE does not reproduce "
            "exactly; export with --no-tokenizer"
        )
    alphabet = list(bytes_to_unicode().values())
    outputs = alphabet + list(producible_tokens(ranks, merges, alphabet))
    vocab = _producible_ids(outputs, encoder, dictionary, encoder_json, vocab_bpe)
    specials = special_symbols(dictionary)
    _add_other_entries(vocab, encoder, dictionary, specials)
    # A merge whose tokens are not all in the vocabulary never applies (its result is never formed).
    kept = [m for m in merges if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=kept,
            dropout=None,
            unk_token=None,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, specials


def _producible_ids(
    outputs: List[str], encoder: Dict[str, int], dictionary: Dictionary, encoder_json: str, vocab_bpe: str
) -> Dict[str, int]:
    """Each token the BPE can output -> the dictionary id of its GPT-2 id's dict.txt entry; every one must have
    a GPT-2 id and an entry."""
    vocab: Dict[str, int] = {}
    missing = []
    for token in outputs:
        if token not in encoder:
            raise ValueError(
                f"{encoder_json} has no id for {token!r}, which {vocab_bpe} can output (fairseq fails "
                "on text that produces it); export with --no-tokenizer"
            )
        entry = str(encoder[token])
        if entry in dictionary.indices:
            vocab[token] = dictionary.index(entry)
        else:
            missing.append((token, entry))
    if missing:
        raise missing_error("GPT-2 BPE", missing, len(outputs), dictionary.path)
    return vocab


def _add_other_entries(vocab: Dict[str, int], encoder: Dict[str, int], dictionary: Dictionary, specials: List[str]):
    """The dict.txt entries the BPE never outputs, added to `vocab` so that every id decodes: a GPT-2 id as its
    token's text, any other symbol as itself (appended to `specials`: never produced from text)."""
    token_of_gpt2_id = {str(i): t for t, i in encoder.items()}
    used = set(vocab.values())
    for idx in range(len(dictionary)):
        if idx in used:
            continue
        symbol = dictionary[idx]
        if symbol in specials or symbol not in token_of_gpt2_id:
            token = symbol  # a symbol of its own (not a GPT-2 id): never produced from text
            if symbol not in specials:
                specials.append(symbol)
        else:
            token = token_of_gpt2_id[symbol]  # a GPT-2 token the BPE never outputs: decodes as its text
        if token in vocab:
            raise ValueError(
                f"dict.txt entry {symbol!r} (id {idx}) has the text of the BPE token {token!r} (id "
                f"{vocab[token]}); a tokenizer cannot tell them apart; export with --no-tokenizer"
            )
        vocab[token] = idx
