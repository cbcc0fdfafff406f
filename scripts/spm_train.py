#!/usr/bin/env python3
"""Train a sentencepiece model: the arguments go to sentencepiece's trainer as one string, as upstream
fairseq's scripts/spm_train.py passes them.

    python scripts/spm_train.py --input=train.txt --model_prefix=spm --vocab_size=8000 --character_coverage=1.0 \\
        --model_type=bpe

writes spm.model and spm.vocab. Every `--name=value` is a sentencepiece trainer option (see sentencepiece's
documentation for the list); values cannot contain spaces, since the trainer splits the string on them.
"""

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    try:
        import sentencepiece as spm
    except ImportError:
        print("spm_train.py: error: needs the sentencepiece package: pip install sentencepiece", file=sys.stderr)
        return 1
    try:
        spm.SentencePieceTrainer.Train(" ".join(argv))
    except (RuntimeError, OSError, ValueError) as e:
        print(f"spm_train.py: error: {str(e).strip()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
