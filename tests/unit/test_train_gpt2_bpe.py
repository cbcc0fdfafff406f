"""scripts/train_gpt2_bpe.py: a byte-level BPE trained on one's own text, written as GPT-2's encoder.json /
vocab.bpe and the dict.txt that fairseq-preprocess --srcdict takes. The whole route (encoder script and
fairseq-preprocess --bpe gpt2 giving the same .bin files) runs in tests/docs from examples/large_lm/README.md;
here the files themselves and the script's errors."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from fairseq.data import Dictionary  # noqa: E402
from fairseq.data.encoders.gpt2_bpe_utils import get_encoder  # noqa: E402

from tests.text_fixtures import sample_text  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TEXT = "Hello world, naïve café 日本語 🙂\n\n  tabs\tand   spaces  \n" + sample_text()[:200000]


def load_script():
    spec = importlib.util.spec_from_file_location("train_gpt2_bpe", REPO / "scripts" / "train_gpt2_bpe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("own_bpe")
    (d / "train.raw").write_text(TEXT, encoding="utf-8")
    assert load_script().main(["--vocab-size", "600", "--outdir", str(d / "bpe"), str(d / "train.raw")]) == 0
    return d / "bpe"


def test_files_are_gpt2_format_and_encode_any_text_losslessly(trained):
    vocab = json.loads((trained / "encoder.json").read_text(encoding="utf-8"))
    assert sorted(vocab.values()) == list(range(len(vocab))) and len(vocab) == 600
    assert vocab["<|endoftext|>"] == len(vocab) - 1  # last, as in GPT-2's file
    assert (trained / "vocab.bpe").read_text(encoding="utf-8").startswith("#version: 0.2\n")
    encoder = get_encoder(trained / "encoder.json", trained / "vocab.bpe")
    for line in ["Hello world, naïve café 日本語 🙂", "unseen ÿ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 text", "  x\ty  "]:
        ids = encoder.encode(line)
        assert encoder.decode(ids) == line


def test_dict_txt_is_id_order_padded_to_16(trained):
    vocab = json.loads((trained / "encoder.json").read_text(encoding="utf-8"))
    d = Dictionary.load(str(trained / "dict.txt"))
    assert len(d) % 16 == 0 and len(d) - 16 < 4 + len(vocab) <= len(d)
    assert [d[i + 4] for i in range(len(vocab))] == [str(i) for i in range(len(vocab))]  # index = id + 4
    assert all(d[i].startswith("madeupword") for i in range(4 + len(vocab), len(d)))


def test_bad_arguments_are_one_line(tmp_path, capsys):
    script = load_script()
    with pytest.raises(SystemExit) as e:
        script.main(["--vocab-size", "100", "--outdir", str(tmp_path), __file__])
    assert e.value.code == 2 and "at least 257" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        script.main(["--vocab-size", "500", "--outdir", str(tmp_path), str(tmp_path / "missing.txt")])
    assert e.value.code == 2 and "missing.txt: no such file" in capsys.readouterr().err
