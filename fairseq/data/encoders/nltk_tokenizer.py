"""`--tokenizer nltk`: NLTK's `word_tokenize` (needs the nltk package and its punkt data)."""

from fairseq.data.encoders import register_tokenizer
from fairseq.dataclass import FairseqDataclass


@register_tokenizer("nltk", dataclass=FairseqDataclass)
class NLTKTokenizer:
    def __init__(self, *unused):
        try:
            from nltk.tokenize import word_tokenize  # deferred: optional (not a dependency; an error says so)
        except ImportError:
            raise ImportError(
                "--tokenizer nltk needs nltk: pip install nltk "
                "(and its tokenizer data: python -m nltk.downloader punkt_tab)"
            ) from None
        self.word_tokenize = word_tokenize

    def encode(self, x: str) -> str:
        return " ".join(self.word_tokenize(x))

    def decode(self, x: str) -> str:
        return x
