"""What the GPT-2 and the sentencepiece tokenizers of the export (hf_tokenizer.py, hf_sentencepiece.py) both need
of dict.txt: its special symbols, and the error for tokens it lacks."""

from typing import List, Optional, Tuple

from fairseq.data.dictionary import Dictionary


def special_symbols(dictionary: Dictionary) -> List[str]:
    """The dictionary's special symbols and its madeupword padding (never produced from text)."""
    out = [dictionary[i] for i in range(dictionary.nspecial)]
    out += [
        dictionary[i]
        for i in range(dictionary.nspecial, len(dictionary))
        if dictionary[i].startswith("madeupword") and dictionary.count[i] == 0
    ]
    return out


def missing_error(what: str, missing: List[Tuple[str, str]], total: int, dict_path: Optional[str]) -> ValueError:
    token, entry = missing[0]
    return ValueError(
        f"dict.txt{f' ({dict_path})' if dict_path else ''} lacks {len(missing)} of the {total} tokens {what} can "
        f"output (e.g. {token!r}, entry {entry!r}): fairseq encodes them as <unk>, which a transformers tokenizer "
        "cannot do exactly; export with --no-tokenizer, or train with a dictionary that lists every token "
        "(for GPT-2, its dict.txt)"
    )
