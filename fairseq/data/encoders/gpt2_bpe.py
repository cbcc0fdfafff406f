"""`--bpe gpt2`: GPT-2's byte-level BPE; a line of text <-> its GPT-2 ids as space-separated integers."""

from dataclasses import dataclass, field
from typing import Optional

from fairseq.data.encoders import register_bpe
from fairseq.data.encoders.gpt2_bpe_utils import DOWNLOAD_HINT, ENCODER_JSON_URL, VOCAB_BPE_URL, get_encoder
from fairseq.dataclass import FairseqDataclass


@dataclass
class GPT2BPEConfig(FairseqDataclass):
    gpt2_encoder_json: Optional[str] = field(
        default=None, metadata={"help": f"path to GPT-2's encoder.json (a local copy of {ENCODER_JSON_URL})"}
    )
    gpt2_vocab_bpe: Optional[str] = field(
        default=None, metadata={"help": f"path to GPT-2's vocab.bpe (a local copy of {VOCAB_BPE_URL})"}
    )


@register_bpe("gpt2", dataclass=GPT2BPEConfig)
class GPT2BPE:
    def __init__(self, cfg):
        for flag, value in (("--gpt2-encoder-json", cfg.gpt2_encoder_json), ("--gpt2-vocab-bpe", cfg.gpt2_vocab_bpe)):
            if not value:
                raise ValueError(
                    f"--bpe gpt2 needs {flag} (upstream's default URL is not fetched here): {DOWNLOAD_HINT}"
                )
        self.bpe = get_encoder(cfg.gpt2_encoder_json, cfg.gpt2_vocab_bpe)

    def encode(self, x: str) -> str:
        return " ".join(map(str, self.bpe.encode(x)))

    def decode(self, x: str) -> str:
        # As upstream: `<unk>`, `<mask>` and anything starting with "<" (`<s>`, `</s>`, ...) are literal text;
        # every other token must be a GPT-2 id.
        tokens = []
        for tok in x.split():
            if tok.startswith("<"):
                tokens.append(tok)
                continue
            try:
                tokens.append(int(tok))
            except ValueError:
                raise ValueError(
                    f"GPT-2 BPE decode: {tok!r} is not a GPT-2 id (expected space-separated "
                    "integers as `encode` writes them)"
                ) from None
        return self.bpe.decode(tokens)

    def is_beginning_of_word(self, x: str) -> bool:
        return self.decode(x).startswith(" ")
