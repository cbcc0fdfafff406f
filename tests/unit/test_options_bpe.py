"""--bpe/--tokenizer on the fairseq-preprocess, fairseq-train and fairseq-eval-lm parsers, as upstream's: the
chosen scheme's dataclass adds its own flags and the config gets cfg.bpe / cfg.tokenizer."""

import pytest

from fairseq import options
from fairseq_cli import preprocess

GPT2 = ["--bpe", "gpt2", "--gpt2-encoder-json", "enc.json", "--gpt2-vocab-bpe", "vocab.bpe"]
SPM = ["--bpe", "sentencepiece", "--sentencepiece-model", "spm.model"]


def test_train_parser_stores_bpe_and_tokenizer_in_the_config():
    args = options.parse_args_and_arch(
        options.get_training_parser(),
        ["data", "--arch", "transformer_lm", "--optimizer", "adam", *GPT2, "--tokenizer", "space"],
    )
    cfg = options.convert_namespace_to_config(args)
    assert cfg.bpe._name == "gpt2"
    assert (cfg.bpe.gpt2_encoder_json, cfg.bpe.gpt2_vocab_bpe) == ("enc.json", "vocab.bpe")
    assert cfg.tokenizer._name == "space"
    from fairseq.dataclass.utils import config_to_dict

    saved = config_to_dict(cfg)
    assert saved["bpe"] == {"_name": "gpt2", "gpt2_encoder_json": "enc.json", "gpt2_vocab_bpe": "vocab.bpe"}


def test_no_bpe_by_default():
    args = options.parse_args_and_arch(options.get_training_parser(), ["data", "--arch", "transformer_lm"])
    cfg = options.convert_namespace_to_config(args)
    assert cfg.bpe is None and cfg.tokenizer is None


def test_eval_lm_parser_takes_the_schemes_flags():
    args = options.parse_args_and_arch(
        options.get_eval_lm_parser(), ["data", "--path", "x.pt", *SPM, "--remove-bpe", "sentencepiece"]
    )
    cfg = options.convert_namespace_to_config(args)
    assert cfg.bpe._name == "sentencepiece" and cfg.bpe.sentencepiece_model == "spm.model"
    assert cfg.common_eval.post_process == "sentencepiece"


def test_preprocess_parser_takes_the_schemes_flags():
    args = preprocess.parse_args(["--only-source", "--trainpref", "t", *GPT2])
    assert (args.bpe, args.gpt2_encoder_json, args.gpt2_vocab_bpe) == ("gpt2", "enc.json", "vocab.bpe")
    assert preprocess.parse_args(["--only-source"]).bpe is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--only-source", "--gpt2-encoder-json", "e.json"],  # flag of an unchosen scheme
        ["--only-source", "--bpe", "nosuch"],
    ],
)
def test_preprocess_rejects_unknown_flags_and_schemes(argv, capsys):
    with pytest.raises(SystemExit):
        preprocess.parse_args(argv)
    err = capsys.readouterr().err
    assert "--gpt2-encoder-json" in err or ("nosuch" in err and "gpt2" in err)


def test_unknown_bpe_on_train_parser_lists_the_choices(capsys):
    with pytest.raises(SystemExit):
        options.parse_args_and_arch(
            options.get_training_parser(), ["data", "--arch", "transformer_lm", "--bpe", "nosuch"]
        )
    err = capsys.readouterr().err
    assert "nosuch" in err and "sentencepiece" in err
