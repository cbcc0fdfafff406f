"""`--bpe bytes`: one symbol per UTF-8 byte (whitespace runs normalized to one space, shown as U+2581)."""

from fairseq.data.encoders import register_bpe
from fairseq.data.encoders.byte_utils import SPACE, SPACE_ESCAPE, byte_encode, smart_byte_decode


@register_bpe("bytes")
class Bytes:
    def __init__(self, *unused):
        pass

    @staticmethod
    def encode(x: str) -> str:
        return SPACE.join(byte_encode(x).replace(SPACE, SPACE_ESCAPE))

    @staticmethod
    def decode(x: str) -> str:
        return smart_byte_decode(x.replace(SPACE, "").replace(SPACE_ESCAPE, SPACE))
