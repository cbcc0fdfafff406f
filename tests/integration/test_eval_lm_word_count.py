"""fairseq-eval-lm --remove-bpe counts the same words for the same raw text whatever its tokenizer: plain
whitespace words, subword-nmt `@@ ` pieces, sentencepiece and GPT-2 byte-level BPE each give exactly the
text's whitespace-separated words plus one per line (its </s>), in blocks of 32 tokens that cut words; each
word's log probability is the sum of its pieces'. Tiny models trained here on data made by fairseq-preprocess."""

import re

import pytest

from fairseq_cli import eval_lm, preprocess, train
from tests.text_fixtures import sample_text, train_gpt2_files, train_spm_model
from tests.train_fixtures import console_in_process

pytestmark = pytest.mark.usefixtures("one_thread")

# A line whose characters the sentencepiece model and dictionary never saw: " ☃" is a bare U+2581 and <unk>.
UNSEEN = "a snowman \u2603 and a comet \u2604 here"


def _lines():
    lines = [line.strip() for line in sample_text().split("\n") if line.strip()]
    return lines[200:320]


def _subword_nmt(line):
    """Words cut into pieces of 3 characters, every piece but the last marked with '@@ '."""
    return " ".join("@@ ".join(word[i : i + 3] for i in range(0, len(word), 3)) for word in line.split())


def _route(root, name, train_lines, test_lines, bpe_flags, train_args, max_update=2, srcdict=None):
    directory = root / name
    directory.mkdir()
    (directory / "train.txt").write_text("\n".join(train_lines) + "\n", encoding="utf-8")
    (directory / "test.txt").write_text("\n".join(test_lines) + "\n", encoding="utf-8")
    data = directory / "data-bin"
    preprocess.cli_main(
        [
            "--only-source",
            "--trainpref",
            str(directory / "train.txt"),
            "--validpref",
            str(directory / "test.txt"),
            "--testpref",
            str(directory / "test.txt"),
            "--destdir",
            str(data),
            "--workers",
            "1",
            *map(str, bpe_flags),
            *(["--srcdict", str(srcdict)] if srcdict else []),
        ]
    )
    train.cli_main(train_args(data, directory / "ckpt", *map(str, bpe_flags), max_update=max_update))
    return data, directory / "ckpt" / "checkpoint_last.pt"


@pytest.fixture(scope="module")
def routes(tmp_path_factory, train_args):
    pytest.importorskip("sentencepiece")
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("word_count")
    text = _lines() + [UNSEEN]
    spm_dir = root / "spm_model"
    spm_dir.mkdir()
    spm = train_spm_model(spm_dir, "\n".join(text[:-1]), vocab_size=300)
    gpt2_dir = root / "gpt2_files"
    gpt2_dir.mkdir()
    enc, vocab = train_gpt2_files(gpt2_dir, "\n".join(text), vocab_size=400)
    return text, {
        "plain": (*_route(root, "plain", text, text, [], train_args), ["--remove-bpe"]),
        "subword_nmt": (
            *_route(
                root, "subword_nmt", [_subword_nmt(t) for t in text], [_subword_nmt(t) for t in text], [], train_args
            ),
            ["--remove-bpe"],
        ),
        "sentencepiece": (
            *_route(
                root,
                "sentencepiece",
                text[:-1],
                text,
                ["--bpe", "sentencepiece", "--sentencepiece-model", spm],
                train_args,
            ),
            ["--remove-bpe", "sentencepiece"],
        ),
        "gpt2": (
            *_route(
                root,
                "gpt2",
                text,
                text,
                ["--bpe", "gpt2", "--gpt2-encoder-json", enc, "--gpt2-vocab-bpe", vocab],
                train_args,
            ),
            ["--remove-bpe"],
        ),
    }


def _eval(data, ckpt, *extra):
    status, out, err = console_in_process(
        "fairseq-eval-lm",
        eval_lm.cli_main,
        [
            str(data),
            "--path",
            str(ckpt),
            "--gen-subset",
            "test",
            "--cpu",
            "--num-workers",
            "0",
            "--tokens-per-sample",
            "32",
            "--batch-size",
            "4",
            *map(str, extra),
        ],
    )
    assert status == 0, err
    return out


def _words_and_tokens(out):
    words = int(re.search(r"per word \(([\d,]+) words\)", out).group(1).replace(",", ""))
    tokens = int(re.search(r"Evaluated ([\d,]+) tokens", out).group(1).replace(",", ""))
    return words, tokens


def _word_rows(out):
    """[(word, log p)] of the --output-word-probs lines, in sample order."""
    rows = []
    for line in out.splitlines():
        m = re.match(r"^.*\| INFO \| fairseq_cli.eval_lm \| (\d+) (.*)$", line)
        if m and "[" in m.group(2):
            rows += [(w, float(s)) for w, s in re.findall(r"(.*?) \[(-?[\d.e+-]+|-?inf)\](?:\t|$)", m.group(2))]
    return rows


@pytest.mark.parametrize("route", ["plain", "subword_nmt", "sentencepiece", "gpt2"])
def test_the_same_text_has_the_same_word_count_whatever_its_tokenizer(routes, route):
    text, by_route = routes
    data, ckpt, flags = by_route[route]
    expected = sum(len(line.split()) for line in text) + len(text)  # words + one </s> per line
    words, tokens = _words_and_tokens(_eval(data, ckpt, *flags))
    assert words == expected
    assert route == "plain" or tokens > words  # BPE routes: fewer words than pieces
    # the word output lists the same words: each once, with the summed log probabilities of its pieces
    out = _eval(data, ckpt, *flags, "--output-word-probs")
    rows = _word_rows(out)
    assert len(rows) == expected
    if route != "subword_nmt":  # (its words are the marked text's pieces joined, the text's own words)
        unseen = {"\u2603": "<unk>", "\u2604": "<unk>"} if route == "sentencepiece" else {}  # not in its dict.txt
        assert [w for w, _ in rows if w != "</s>"] == [unseen.get(w, w) for line in text for w in line.split()]
    token_rows = _word_rows(_eval(data, ckpt, "--output-word-probs"))  # without --remove-bpe: one per token
    assert len(token_rows) == tokens
    assert sum(lp for _, lp in rows) == pytest.approx(sum(lp for _, lp in token_rows), abs=1e-3)


def _vocab_dict(spm_model, path):
    """dict.txt from the sentencepiece model's whole vocabulary, upstream's recipe (examples/large_lm/README.md):
    `cut -f1 spm.vocab | tail -n +4 | sed "s/$/ 100/g" > dict.txt` (the first three are <unk>, <s>, </s>)."""
    pieces = [line.split("\t")[0] for line in spm_model.with_suffix(".vocab").read_text(encoding="utf-8").splitlines()]
    path.write_text("".join(f"{p} 100\n" for p in pieces[3:]), encoding="utf-8")
    return path


def test_pieces_missing_from_dict_txt_are_warned_about_and_a_dict_of_the_whole_vocab_has_none(tmp_path, train_args):
    """The README's sentencepiece route built dict.txt from the train split: a test piece the train text never
    produced is <unk>, which carries no U+2581, so words merge. eval-lm says how many <unk> tokens there are;
    dict.txt made from the model's vocabulary (the README's route now) leaves none and counts every word."""
    pytest.importorskip("sentencepiece")
    lines = _lines()
    train_lines, test_lines = lines[:40], lines[40:100]
    spm_dir = tmp_path / "spm_model"
    spm_dir.mkdir()
    spm = train_spm_model(spm_dir, "\n".join(lines), vocab_size=300)  # every character seen: no unknown ones
    bpe = ["--bpe", "sentencepiece", "--sentencepiece-model", spm]
    expected = sum(len(line.split()) for line in test_lines) + len(test_lines)
    data, ckpt = _route(tmp_path, "from_train", train_lines, test_lines, bpe, train_args)
    out = _eval(data, ckpt, "--remove-bpe", "sentencepiece")
    warnings = [line.split(" | ", 3)[3] for line in out.splitlines() if "| WARNING |" in line and "<unk>" in line]
    assert len(warnings) == 1, out[-3000:]
    unknown = int(re.search(r"holds ([\d,]+) <unk> tokens", warnings[0]).group(1).replace(",", ""))
    words, _ = _words_and_tokens(out)
    assert 0 < expected - words <= unknown  # merged words, no more than the warning announced
    assert warnings[0] == (
        f"--remove-bpe: the scored text holds {unknown:,} <unk> tokens (pieces not in dict.txt); "
        f"the word count, and so the per-word perplexity, may differ from the raw text's by up "
        f"to {unknown:,} words. Fix: build dict.txt from the tokenizer's whole vocabulary (for "
        "sentencepiece its .vocab, examples/large_lm/README.md) and binarize with it (--srcdict)"
    )
    vocab_dict = _vocab_dict(spm, tmp_path / "spm_dict.txt")
    data, ckpt = _route(tmp_path, "from_vocab", train_lines, test_lines, bpe, train_args, srcdict=vocab_dict)
    out = _eval(data, ckpt, "--remove-bpe", "sentencepiece")
    assert _words_and_tokens(out)[0] == expected and "<unk>" not in out
