"""`--bpe sentencepiece`: a sentencepiece model; a line of text <-> its pieces separated by spaces."""

import os
from dataclasses import dataclass, field
from typing import Optional

from fairseq.data.encoders import register_bpe
from fairseq.dataclass import FairseqDataclass

SPACE_MARK = "\u2581"  # sentencepiece's word-boundary mark


@dataclass
class SentencepieceConfig(FairseqDataclass):
    sentencepiece_model: Optional[str] = field(default=None, metadata={"help": "path to the sentencepiece model"})
    sentencepiece_enable_sampling: bool = field(default=False, metadata={"help": "enable sampling"})
    sentencepiece_alpha: Optional[float] = field(
        default=None,
        metadata={"help": "smoothing parameter for unigram sampling, and merge probability for BPE-dropout"})


def load_sentencepiece(path):
    """A SentencePieceProcessor for `path`, with errors that name the file."""
    if not path:
        raise ValueError("--bpe sentencepiece needs --sentencepiece-model PATH (a .model file written by "
                         "scripts/spm_train.py or sentencepiece's trainer)")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"sentencepiece model {path!r} does not exist; train one with "
                                "`python scripts/spm_train.py --input=train.txt --model_prefix=spm --vocab_size=...`"
                                " and pass the .model file")
    try:
        import sentencepiece as spm
    except ImportError:
        raise ImportError("--bpe sentencepiece needs the sentencepiece package: pip install sentencepiece") from None
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(path)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"sentencepiece model {path!r} could not be loaded ({str(e).strip()}); is it a "
                         ".model file written by sentencepiece's trainer (not the .vocab)?") from None
    return sp


@register_bpe("sentencepiece", dataclass=SentencepieceConfig)
class SentencepieceBPE:
    def __init__(self, cfg):
        self.enable_sampling = cfg.sentencepiece_enable_sampling
        self.alpha = cfg.sentencepiece_alpha
        self.sp = load_sentencepiece(cfg.sentencepiece_model)

    def encode(self, x: str) -> str:
        return " ".join(self.sp.Encode(x, out_type=str, enable_sampling=self.enable_sampling, alpha=self.alpha))

    def decode(self, x: str) -> str:
        return x.replace(" ", "").replace(SPACE_MARK, " ").strip()

    def is_beginning_of_word(self, x: str) -> bool:
        # Special symbols that are also pieces of the model count as word beginnings, as upstream.
        if x in ("<unk>", "<s>", "</s>", "<pad>"):
            return True
        return x.startswith(SPACE_MARK)
