"""`--bpe characters`: one symbol per character (spaces shown as U+2581)."""

from fairseq.data.encoders import register_bpe
from fairseq.data.encoders.byte_utils import SPACE, SPACE_ESCAPE


@register_bpe("characters")
class Characters:
    def __init__(self, *unused):
        pass

    @staticmethod
    def encode(x: str) -> str:
        return SPACE.join(x.replace(SPACE, SPACE_ESCAPE))

    @staticmethod
    def decode(x: str) -> str:
        return x.replace(SPACE, "").replace(SPACE_ESCAPE, SPACE)
