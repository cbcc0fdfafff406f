"""Tiny transformers OPT and XGLM model directories made on the spot (no network), with tokenizer files laid out as
the released ones: OPT's vocab.json (<s> <pad> </s> <unk> at 0-3, then the byte-level BPE's tokens in an order of
their own, as OPT's follows its fairseq dictionary) + merges.txt + OPT's tokenizer_config.json; XGLM's
sentencepiece.bpe.model (a unigram model, as XGLM's) + the tokenizer.json transformers' XGLMTokenizer makes of it."""

import json
import random
import shutil

import torch

from tests.text_fixtures import sample_text, train_byte_level_bpe

TINY = {
    "opt": dict(
        hidden_size=32, num_hidden_layers=2, ffn_dim=48, num_attention_heads=4, max_position_embeddings=64, dropout=0.0
    ),
    "xglm": dict(
        d_model=32,
        num_layers=2,
        ffn_dim=48,
        attention_heads=4,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
    ),
}


def write_opt_tokenizer(directory, vocab_size: int = 400, seed: int = 0) -> int:
    """OPT-style vocab.json / merges.txt / tokenizer_config.json in `directory`; returns the number of ids."""
    vocab, merges = train_byte_level_bpe(sample_text()[:200000], vocab_size)
    tokens = sorted(vocab, key=vocab.get)
    random.Random(seed).shuffle(tokens)
    hf_vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for token in tokens:
        hf_vocab[token] = len(hf_vocab)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(hf_vocab, ensure_ascii=False), encoding="utf-8")
    (directory / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {  # OPT's own, as released
                "add_bos_token": True,
                "add_prefix_space": False,
                "bos_token": "</s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "unk_token": "</s>",
                "errors": "replace",
                "tokenizer_class": "GPT2Tokenizer",
            }
        )
    )
    return len(hf_vocab)


def write_xglm_tokenizer(directory, vocab_size: int = 300) -> int:
    """A unigram sentencepiece.bpe.model and the tokenizer.json transformers' XGLMTokenizer builds from its pieces
    (transformers' XGLMConverter's layout: the four specials, the pieces after the model's first three, seven
    <madeupwordN>); returns the number of ids."""
    import sentencepiece as spm
    import transformers

    from fairseq.export.hf_sentencepiece import read_model

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "spm_train.txt").write_text(sample_text()[:300000], encoding="utf-8")
    spm.SentencePieceTrainer.Train(
        f"--input={directory / 'spm_train.txt'} --model_prefix={directory / 'spm'} "
        f"--vocab_size={vocab_size} --model_type=unigram --minloglevel=2"
    )
    shutil.move(str(directory / "spm.model"), str(directory / "sentencepiece.bpe.model"))
    for name in ("spm.vocab", "spm_train.txt"):
        (directory / name).unlink()
    model = read_model(str(directory / "sentencepiece.bpe.model"))
    vocab = [(s, 0.0) for s in ("<s>", "<pad>", "</s>", "<unk>")] + [(p, score) for p, score, _ in model["pieces"][3:]]
    vocab += [(f"<madeupword{i}>", 0.0) for i in range(7)]
    transformers.XGLMTokenizer(vocab=vocab, _spm_precompiled_charsmap=model["charsmap"]).save_pretrained(str(directory))
    return len(vocab)


def tiny_hf_model(
    directory,
    model_type: str,
    tokenizer_dir,
    vocab: int,
    seed: int = 0,
    dtype=None,
    max_shard_size=None,
    pickle=False,
    **options,
):
    """A random `model_type` model (TINY + `options`) with every parameter perturbed (layer norms too), saved to
    `directory` with the tokenizer files of `tokenizer_dir`: as safetensors (sharded with `max_shard_size`), or
    as a pytorch_model.bin of the base model's names (the released OPT / XGLM files' layout; pickle="legacy":
    in the format of torch before 1.6, which cannot be memory-mapped)."""
    import transformers

    config_cls, model_cls = (
        (transformers.OPTConfig, transformers.OPTForCausalLM)
        if model_type == "opt"
        else (transformers.XGLMConfig, transformers.XGLMForCausalLM)
    )
    config = config_cls(vocab_size=-(-vocab // 8) * 8, **{**TINY[model_type], **options})
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    if dtype is not None:
        model = model.to(dtype)
    shutil.copytree(str(tokenizer_dir), str(directory), dirs_exist_ok=True)
    if pickle:
        config.save_pretrained(str(directory))
        torch.save(
            model.model.state_dict(),
            str(directory / "pytorch_model.bin"),
            _use_new_zipfile_serialization=pickle != "legacy",
        )  # "legacy": torch < 1.6's format
    else:
        model.save_pretrained(str(directory), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return directory
