"""Text and tokenizer-model builders shared by the tests (no network: the models are trained on the spot)."""

import json


def sample_text() -> str:
    """About 1 MB of English prose with code and punctuation, from the standard library (Python's help topics)."""
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics))


def train_byte_level_bpe(text: str, vocab_size: int):
    """(vocab, merges) of a GPT-2-style byte-level BPE trained with `tokenizers` on `text`'s paragraphs."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return model["vocab"], merges


def write_gpt2_files(directory, vocab, merges, extra_tokens=("<|endoftext|>",)):
    """encoder.json and vocab.bpe in GPT-2's format (upstream's file names) from a vocab and merges."""
    vocab = dict(vocab)
    for tok in extra_tokens:
        vocab.setdefault(tok, len(vocab))
    enc, bpe = directory / "encoder.json", directory / "vocab.bpe"
    enc.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    bpe.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return enc, bpe


def train_gpt2_files(directory, text: str, vocab_size: int = 1500):
    return write_gpt2_files(directory, *train_byte_level_bpe(text, vocab_size))


def write_full_gpt2_dict(encoder_json, path) -> None:
    """A dict.txt listing every GPT-2 id of `encoder_json`, shuffled (as GPT-2's own lists all of them), padded
    to a multiple of 8: the export then has a tokenizer for every id."""
    import random

    from fairseq.data import Dictionary

    ids = list(json.loads(open(encoder_json, encoding="utf-8").read()).values())
    random.Random(0).shuffle(ids)
    dictionary = Dictionary()
    for i in ids:
        dictionary.add_symbol(str(i))
    dictionary.pad_to_multiple_(8)
    dictionary.save(str(path))


def train_spm_model(directory, text: str = None, vocab_size: int = 300):
    """A sentencepiece BPE model trained on `text` (default: sample_text()); returns the .model path."""
    import sentencepiece as spm

    (directory / "spm_train.txt").write_text(sample_text() if text is None else text, encoding="utf-8")
    spm.SentencePieceTrainer.Train(
        f"--input={directory / 'spm_train.txt'} --model_prefix={directory / 'spm'} "
        f"--vocab_size={vocab_size} --model_type=bpe --minloglevel=2"
    )
    return directory / "spm.model"
