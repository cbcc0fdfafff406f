"""Text in and out of a loaded model, shared by the hub interface (fairseq.hub.hub_utils) and the commands that
print text (fairseq-generate, fairseq-interactive) or serve it: the tokenizer + BPE codec, the pieces of a
hypothesis shown while it grows, and batches moved to the model's device.
"""

import torch

from fairseq.data import encoders


class TextCodec:
    """Text <-> the dictionary's symbols: --tokenizer, then --bpe (and back in the reverse order), as upstream's
    commands and hub interface apply them. `tokenizer_cfg`/`bpe_cfg`: anything build_tokenizer/build_bpe take."""

    def __init__(self, tokenizer_cfg=None, bpe_cfg=None):
        self.tokenizer = encoders.build_tokenizer(tokenizer_cfg)
        self.bpe = encoders.build_bpe(bpe_cfg)

    def encode(self, text: str) -> str:
        if self.tokenizer is not None:
            text = self.tokenizer.encode(text)
        return self.bpe.encode(text) if self.bpe is not None else text

    def decode(self, text: str) -> str:
        if self.bpe is not None:
            text = self.bpe.decode(text)
        return self.tokenizer.decode(text) if self.tokenizer is not None else text


def first_streamed_hypothesis(tokens: torch.Tensor, pad: int) -> torch.Tensor:
    """The first sentence's tokens of a streamed batch (`on_tokens`' [B, T]): without the begin-of-sentence
    token and the <pad> after its end."""
    row = tokens[0, 1:]
    return row[row.ne(pad)]


class TextPieces:
    """The text of a hypothesis shown in pieces as its tokens arrive (hub.stream, fairseq-interactive --stream):
    `extend(text)` gives what `text` adds to what was shown, or "" when it does not extend it or, before the
    end, ends inside a multi-byte character (U+FFFD); joined, the pieces are the final text."""

    def __init__(self):
        self.shown = ""

    def extend(self, text: str, final: bool = False) -> str:
        piece = text[len(self.shown) :]
        if not piece or not text.startswith(self.shown) or (not final and "\ufffd" in piece):
            return ""
        self.shown = text
        return piece


def move_to(sample, device: torch.device):
    """A batch (nested dicts, lists and tensors) with every tensor on `device`."""
    if torch.is_tensor(sample):
        return sample.to(device)
    if isinstance(sample, dict):
        return {key: move_to(value, device) for key, value in sample.items()}
    if isinstance(sample, (list, tuple)):
        return type(sample)(move_to(value, device) for value in sample)
    return sample
