"""`--bpe sentencepiece`: a sentencepiece model; a line of text <-> its pieces separated by spaces."""

from dataclasses import dataclass, field
from typing import Optional

from fairseq.data.encoders import register_bpe
from fairseq.dataclass import FairseqDataclass
from fairseq.data.encoders._script_io import load_sentencepiece

SPACE_MARK = "\u2581"  # sentencepiece's word-boundary mark


@dataclass
class SentencepieceConfig(FairseqDataclass):
    sentencepiece_model: Optional[str] = field(default=None, metadata={"help": "path to the sentencepiece model"})
    sentencepiece_enable_sampling: bool = field(default=False, metadata={"help": "enable sampling"})
    sentencepiece_alpha: Optional[float] = field(
        default=None,
        metadata={"help": "smoothing parameter for unigram sampling, and merge probability for BPE-dropout"},
    )


@register_bpe("sentencepiece", dataclass=SentencepieceConfig)
class SentencepieceBPE:
    def __init__(self, cfg):
        self.enable_sampling = cfg.sentencepiece_enable_sampling
        self.alpha = cfg.sentencepiece_alpha
        if not cfg.sentencepiece_model:
            raise ValueError(
                "--bpe sentencepiece needs --sentencepiece-model PATH (a .model file written by "
                "scripts/spm_train.py or sentencepiece's trainer)"
            )
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
