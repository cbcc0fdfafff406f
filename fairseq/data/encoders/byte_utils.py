"""Byte <-> character tables of the `bytes` scheme (upstream's byte_utils): every UTF-8 byte is shown as one
character, the byte itself where it is printable Latin-1 (32-126, 161-172, 174-255), else chr(256 + byte)."""

import re

WHITESPACE_NORMALIZER = re.compile(r"\s+")
SPACE = chr(32)
SPACE_ESCAPE = chr(9601)  # U+2581, stands for a space inside an encoded token
PRINTABLE_LATIN = set(range(32, 127)) | set(range(161, 173)) | set(range(174, 256))  # no-break space excluded
BYTE_TO_BCHAR = {b: chr(b) if b in PRINTABLE_LATIN else chr(256 + b) for b in range(256)}
BCHAR_TO_BYTE = {c: b for b, c in BYTE_TO_BCHAR.items()}


def byte_encode(x: str) -> str:
    """Whitespace runs become one space; then one character per UTF-8 byte."""
    return "".join(BYTE_TO_BCHAR[b] for b in WHITESPACE_NORMALIZER.sub(SPACE, x).encode("utf-8"))


def byte_decode(x: str) -> str:
    """Inverse of `byte_encode`; "" when the bytes are not valid UTF-8."""
    try:
        return bytes(BCHAR_TO_BYTE[c] for c in x).decode("utf-8")
    except KeyError as e:
        raise ValueError(f"bytes decode: {e.args[0]!r} is not a byte character of the `bytes` scheme") from None
    except UnicodeDecodeError:
        return ""


def smart_byte_decode(x: str) -> str:
    """`byte_decode`, or, when the bytes are not valid UTF-8 as a whole, the longest run of characters that
    can be recovered: a dynamic program over cut points that keeps segments of 1-4 bytes which decode on
    their own, maximising the number of kept segments, and drops the other bytes (upstream's rule)."""
    out = byte_decode(x)
    if out != "":
        return out
    n = len(x)
    best = [0] * (n + 1)  # best[i]: most characters recoverable from x[:i]
    back = [0] * (n + 1)  # where the last step to i came from
    for i in range(1, n + 1):
        best[i], back[i] = best[i - 1], i - 1  # skip byte i-1
        for j in range(1, min(4, i) + 1):
            if best[i - j] + 1 > best[i] and byte_decode(x[i - j : i]):
                best[i], back[i] = best[i - j] + 1, i - j
    pieces = []
    i = n
    while i > 0:
        if best[i] == best[back[i]] + 1:
            pieces.append(byte_decode(x[back[i] : i]))
        i = back[i]
    return "".join(reversed(pieces))
