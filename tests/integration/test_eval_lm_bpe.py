"""fairseq-eval-lm --remove-bpe sentencepiece and --bpe gpt2: per-word log probabilities are the sums of their
pieces' log probabilities, the word count is the number of word beginnings (the same count for every
tokenizer: test_eval_lm_word_count.py); fairseq-train and fairseq-eval-lm
accept --bpe and its scheme's flags, and the checkpoint keeps them. A tiny model trained here on data made by
fairseq-preprocess --bpe (no network)."""

import logging
import re

import pytest
import torch

from fairseq_cli import eval_lm, preprocess, train

from tests.text_fixtures import sample_text, train_gpt2_files, train_spm_model

SPACE = "\u2581"


def _corpus(directory):
    lines = [line.strip() for line in sample_text().split("\n") if line.strip()]
    (directory / "train.txt").write_text("\n".join(lines[:3000]) + "\n", encoding="utf-8")
    (directory / "test.txt").write_text("\n".join(lines[3000:3080]) + "\n", encoding="utf-8")
    return directory / "train.txt", directory / "test.txt"


def _prepare(root, bpe_flags):
    train_txt, test_txt = _corpus(root)
    dest = root / "data-bin"
    preprocess.cli_main(
        [
            "--only-source",
            "--trainpref",
            str(train_txt),
            "--validpref",
            str(test_txt),
            "--testpref",
            str(test_txt),
            "--destdir",
            str(dest),
            *map(str, bpe_flags),
        ]
    )
    return dest


@pytest.fixture(scope="module")
def spm_setup(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    root = tmp_path_factory.mktemp("spm_lm")
    flags = ["--bpe", "sentencepiece", "--sentencepiece-model", train_spm_model(root)]
    return _prepare(root, flags), flags, root


@pytest.fixture(scope="module")
def gpt2_setup(tmp_path_factory):
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("gpt2_lm")
    enc, vocab = train_gpt2_files(root, sample_text(), vocab_size=600)
    flags = ["--bpe", "gpt2", "--gpt2-encoder-json", enc, "--gpt2-vocab-bpe", vocab]
    return _prepare(root, flags), flags, root


def _train(data, save_dir, train_args, bpe_flags):
    train.cli_main(train_args(data, save_dir, *map(str, bpe_flags), max_update=3))
    return save_dir / "checkpoint_last.pt"


def _eval(data, ckpt, caplog, *extra):
    from fairseq import options

    parser = options.get_eval_lm_parser()
    args = options.parse_args_and_arch(
        parser,
        [
            str(data),
            "--path",
            str(ckpt),
            "--gen-subset",
            "test",
            "--tokens-per-sample",
            "32",
            "--batch-size",
            "4",
            "--cpu",
            "--output-word-probs",
            *map(str, extra),
        ],
    )
    cfg = options.convert_namespace_to_config(args)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fairseq_cli.eval_lm"):
        result = eval_lm.main(cfg)
    rows = {}
    for record in caplog.records:
        m = re.match(r"^(\d+) (.*)$", record.getMessage(), re.S)
        if m and "[" in m.group(2):
            rows[int(m.group(1))] = [
                (w, float(s)) for w, s in re.findall(r"(.*?) \[(-?[\d.e+-]+|-?inf)\](?:\t|$)", m.group(2))
            ]
    return result, rows


def _check_words(token_rows, word_rows, result_tokens, result):
    """Every counted piece is in one listed word (words cut by a sample's end are completed by the next
    sample's first pieces: test_eval_lm_word_count.py), so the word log probabilities sum to the pieces'."""
    words = [w for ws in word_rows.values() for w in ws]
    pieces = [t for ts in token_rows.values() for t in ts]
    assert sum(score for _, score in words) == pytest.approx(sum(score for _, score in pieces), abs=1e-3)
    assert result["words"] == len(words) < result_tokens["tokens"] == result["tokens"] == len(pieces)
    # loss per word: the same summed bits over fewer units
    assert result["loss"] * result["words"] == pytest.approx(result_tokens["loss"] * result_tokens["tokens"], rel=1e-6)


def test_train_and_eval_lm_accept_bpe_flags_and_the_checkpoint_keeps_them(spm_setup, tmp_path, train_args):
    data, flags, _ = spm_setup
    ckpt = _train(data, tmp_path, train_args, flags)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["cfg"]["bpe"]
    assert saved["_name"] == "sentencepiece" and saved["sentencepiece_model"] == str(flags[-1])


def test_eval_lm_remove_bpe_sentencepiece_joins_pieces_into_words(spm_setup, tmp_path, train_args, caplog):
    data, flags, _ = spm_setup
    ckpt = _train(data, tmp_path, train_args, flags)
    tok_result, tok_rows = _eval(data, ckpt, caplog)
    word_result, word_rows = _eval(data, ckpt, caplog, "--remove-bpe", "sentencepiece")
    assert "words" not in tok_result and tok_rows
    _check_words(tok_rows, word_rows, tok_result, word_result)
    # words are shown without the U+2581 marks
    assert all(SPACE not in w for ws in word_rows.values() for w, _ in ws)
    # the same boundaries from the sentencepiece model itself (--bpe sentencepiece with the bare --remove-bpe)
    again, again_rows = _eval(data, ckpt, caplog, *flags, "--remove-bpe")
    assert again["words"] == word_result["words"] and again["loss"] == pytest.approx(word_result["loss"])


def test_eval_lm_bpe_gpt2_word_boundaries_from_the_encoder(gpt2_setup, tmp_path, train_args, caplog):
    data, flags, _ = gpt2_setup
    ckpt = _train(data, tmp_path, train_args, flags)
    tok_result, tok_rows = _eval(data, ckpt, caplog)
    word_result, word_rows = _eval(data, ckpt, caplog, *flags, "--remove-bpe")
    _check_words(tok_rows, word_rows, tok_result, word_result)
    # words are decoded text; a word with a leading space in GPT-2 is shown without it
    assert any(w.isalpha() for ws in word_rows.values() for w, _ in ws)
    # without --bpe on the command line, --remove-bpe uses the bpe saved in the checkpoint
    saved_result, _ = _eval(data, ckpt, caplog, "--remove-bpe")
    assert saved_result["words"] == word_result["words"]


def test_remove_bpe_gpt2_without_the_encoder_is_a_clear_error(spm_setup, tmp_path, train_args, caplog):
    data, flags, _ = spm_setup
    ckpt = _train(data, tmp_path, train_args, [])
    with pytest.raises(ValueError, match="--gpt2-encoder-json"):
        _eval(data, ckpt, caplog, "--remove-bpe", "gpt2")
