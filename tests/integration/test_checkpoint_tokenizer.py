"""A checkpoint carries its tokenizer (issue 29, items 4, 8, 9, 10): fairseq-train writes the dictionary's
fingerprint and the --bpe files' content into every checkpoint (single file and sharded, kept by copies and by
consolidation, loadable with weights_only=True); interactive, generate, eval-lm, from_pretrained and the export
use them from another directory after the files are deleted; a same-size but different dict.txt is refused; a
missing tokenizer file is one error line at start-up; checkpoints that only hold paths keep working."""

import os
import shutil

import pytest
import torch

from fairseq.data.dictionary import Dictionary
from fairseq_cli import eval_lm, generate, interactive, preprocess
from tests.text_fixtures import sample_text, train_gpt2_files, train_spm_model, write_full_gpt2_dict
from tests.train_fixtures import console_in_process, tiny_train_argv, train_in_process

pytestmark = pytest.mark.usefixtures("one_thread")

BPE_FLAGS = [
    "--bpe",
    "gpt2",
    "--gpt2-encoder-json",
    "gpt2_bpe/encoder.json",
    "--gpt2-vocab-bpe",
    "gpt2_bpe/vocab.bpe",
]  # relative: saved as given, from directory A
PROMPT = "the meaning of"


def _corpus(directory, n_train=300):
    lines = [line.strip() for line in sample_text().split("\n") if line.strip()]
    (directory / "train.txt").write_text("\n".join(lines[:n_train]) + "\n", encoding="utf-8")
    (directory / "valid.txt").write_text("\n".join(lines[n_train : n_train + 40]) + "\n", encoding="utf-8")


def _train(root, data, save_dir, *extra):
    argv = tiny_train_argv(
        data,
        save_dir,
        "--disable-validation",
        *extra,
        max_update=3,
        arch="transformer_lm_gpt",
        json_log=False,
        log_file=False,
    )
    status, out, err = train_in_process(argv)
    assert status == 0, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """In directory A: GPT-2 BPE files, fairseq-preprocess --bpe gpt2 and fairseq-train --bpe gpt2 with relative
    paths; then the BPE files are deleted (a copy is kept elsewhere as the reference)."""
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("carried")
    a, keep = root / "A", root / "keep"
    (a / "gpt2_bpe").mkdir(parents=True)
    keep.mkdir()
    enc, vocab = train_gpt2_files(a / "gpt2_bpe", sample_text(), vocab_size=600)
    write_full_gpt2_dict(enc, a / "gpt2_bpe" / "dict.txt")
    _corpus(a)
    cwd = os.getcwd()
    os.chdir(a)
    try:
        preprocess.cli_main(
            [
                "--only-source",
                "--srcdict",
                "gpt2_bpe/dict.txt",
                "--trainpref",
                "train.txt",
                "--validpref",
                "valid.txt",
                "--destdir",
                "data-bin",
                "--workers",
                "1",
                *BPE_FLAGS,
            ]
        )
        _train(a, "data-bin", "checkpoints", "--save-interval-updates", "3", *BPE_FLAGS)  # + a copy
    finally:
        os.chdir(cwd)
    for f in (enc, vocab):
        shutil.copy(f, keep / f.name)
    original = {"encoder.json": enc.read_bytes(), "vocab.bpe": vocab.read_bytes()}
    shutil.rmtree(a / "gpt2_bpe")
    b = root / "B"
    b.mkdir()
    return {
        "data": a / "data-bin",
        "ckpt": a / "checkpoints" / "checkpoint_last.pt",
        "keep": keep,
        "b": b,
        "original": original,
        "root": root,
    }


def _explicit(trained):
    keep = trained["keep"]
    return ["--bpe", "gpt2", "--gpt2-encoder-json", keep / "encoder.json", "--gpt2-vocab-bpe", keep / "vocab.bpe"]


def _interactive(trained, *extra, path=None, data=None):
    prompts = trained["root"] / "prompts.txt"
    prompts.write_text(PROMPT + "\n", encoding="utf-8")
    argv = [
        data or trained["data"],
        "--path",
        path or trained["ckpt"],
        "--cpu",
        "--beam",
        "1",
        "--max-len-b",
        "12",
        "--input",
        prompts,
        *extra,
    ]
    return console_in_process("fairseq-interactive", interactive.cli_main, list(map(str, argv)))


def _lines(out, kinds):
    return [line for line in out.splitlines() if line[:2] in tuple(f"{k}-" for k in kinds)]


def test_every_checkpoint_carries_the_dictionary_fingerprint_and_the_bpe_files(trained):
    from fairseq.checkpoint.vocabulary import dictionary_sha256

    save_dir = trained["ckpt"].parent
    names = sorted(p.name for p in save_dir.glob("*.pt"))
    assert "checkpoint_last.pt" in names and len(names) >= 2  # checkpoint_1_3.pt and its copy
    dictionary = Dictionary.load(str(trained["data"] / "dict.txt"))
    for name in names:
        state = torch.load(save_dir / name, weights_only=True)
        record = state["vocabulary"]
        assert record["dictionary_sha256"] == dictionary_sha256(dictionary)
        assert record["dictionary_size"] == len(dictionary)
        files = record["bpe"]["files"]
        assert record["bpe"]["_name"] == "gpt2" and state["cfg"]["bpe"]["_name"] == "gpt2"
        assert files["gpt2_encoder_json"]["content"] == trained["original"]["encoder.json"]
        assert files["gpt2_vocab_bpe"]["content"] == trained["original"]["vocab.bpe"]
        assert files["gpt2_encoder_json"]["name"] == "encoder.json"
        assert state["model"] and state["cfg"]["model"]  # the existing keys stay


def test_interactive_and_generate_use_the_checkpoints_bpe_from_another_directory(trained, monkeypatch):
    monkeypatch.chdir(trained["b"])
    status, out, err = _interactive(trained)
    assert status == 0, err
    source = _lines(out, "S")
    assert len(source) == 1 and "<unk>" not in source[0]
    decoded = _lines(out, "D")[0].split("\t")[2]
    assert decoded.startswith(PROMPT)
    status, flagged, err = _interactive(trained, *_explicit(trained))
    assert status == 0, err
    assert _lines(out, "SHDP") == _lines(flagged, "SHDP")
    # fairseq-generate decodes its S-/T-/D- lines with it too
    args = [
        trained["data"],
        "--path",
        trained["ckpt"],
        "--cpu",
        "--gen-subset",
        "valid",
        "--tokens-per-sample",
        "32",
        "--batch-size",
        "8",
        "--prefix-size",
        "4",
        "--beam",
        "1",
        "--max-len-b",
        "8",
        "--num-workers",
        "0",
    ]
    status, out, err = console_in_process("fairseq-generate", generate.cli_main, list(map(str, args)))
    assert status == 0, err
    status, flagged, err = console_in_process(
        "fairseq-generate", generate.cli_main, list(map(str, args + _explicit(trained)))
    )
    assert status == 0, err
    assert _lines(out, "STHD") == _lines(flagged, "STHD") and _lines(out, "D")
    assert not any(line.split("\t")[-1].split()[0].isdigit() for line in _lines(out, "T"))  # text, not ids


def test_eval_lm_remove_bpe_and_from_pretrained_from_another_directory(trained, monkeypatch):
    from fairseq.models.transformer_lm import TransformerLanguageModel

    monkeypatch.chdir(trained["b"])
    args = [
        trained["data"],
        "--path",
        trained["ckpt"],
        "--cpu",
        "--gen-subset",
        "valid",
        "--tokens-per-sample",
        "32",
        "--batch-size",
        "8",
        "--remove-bpe",
        "--num-workers",
        "0",
    ]
    status, out, err = console_in_process("fairseq-eval-lm", eval_lm.cli_main, list(map(str, args)))
    assert status == 0, err
    assert "word boundaries from the checkpoint's --bpe gpt2" in out
    status, flagged, err = console_in_process(
        "fairseq-eval-lm", eval_lm.cli_main, list(map(str, args + _explicit(trained)))
    )
    assert status == 0, err
    perplexity = [line.split("Perplexity")[1] for line in out.splitlines() if "Perplexity" in line]
    assert perplexity and perplexity == [
        line.split("Perplexity")[1] for line in flagged.splitlines() if "Perplexity" in line
    ]

    lm = TransformerLanguageModel.from_pretrained(
        str(trained["ckpt"].parent), "checkpoint_last.pt", data_name_or_path=str(trained["data"])
    )
    ids = lm.encode(PROMPT)
    assert lm.src_dict.unk() not in ids.tolist() and lm.decode(ids) == PROMPT
    keep = trained["keep"]
    given = TransformerLanguageModel.from_pretrained(
        str(trained["ckpt"].parent),
        "checkpoint_last.pt",
        data_name_or_path=str(trained["data"]),
        bpe="gpt2",
        gpt2_encoder_json=str(keep / "encoder.json"),
        gpt2_vocab_bpe=str(keep / "vocab.bpe"),
    )
    assert given.encode(PROMPT).tolist() == ids.tolist()
    assert lm.sample(PROMPT, beam=1, max_len_b=10) == given.sample(PROMPT, beam=1, max_len_b=10)


def test_export_writes_the_carried_tokenizer_from_another_directory(trained, monkeypatch):
    pytest.importorskip("transformers")
    from fairseq.export import hf

    monkeypatch.chdir(trained["b"])
    out = trained["b"] / "hf"
    result = hf.export(str(trained["ckpt"]), str(out), dict_path=str(trained["data"] / "dict.txt"))
    assert result["tokenizer"] == "gpt2"
    keep = trained["keep"]
    reference = trained["b"] / "hf_flags"
    hf.export(
        str(trained["ckpt"]),
        str(reference),
        dict_path=str(trained["data"] / "dict.txt"),
        bpe={
            "_name": "gpt2",
            "gpt2_encoder_json": str(keep / "encoder.json"),
            "gpt2_vocab_bpe": str(keep / "vocab.bpe"),
        },
    )
    assert (out / "tokenizer.json").read_bytes() == (reference / "tokenizer.json").read_bytes()


# ------------------------------------------------------------------------------------------ item 4


@pytest.fixture(scope="module")
def swapped_data(trained):
    """The data directory with a dict.txt of the same size whose two lines are swapped."""
    data = trained["root"] / "swapped"
    shutil.copytree(trained["data"], data)
    lines = (data / "dict.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    lines[0], lines[1] = lines[1], lines[0]
    (data / "dict.txt").write_text("".join(lines), encoding="utf-8")
    return data


def _one_mismatch_line(err, data, ckpt):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert str(data / "dict.txt") in lines[0] and str(ckpt) in lines[0]
    assert "both have" in lines[0] and "use the dict.txt the model was trained with" in lines[0]


def test_a_same_size_but_different_dictionary_is_refused(trained, swapped_data):
    ckpt = trained["ckpt"]
    status, _, err = _interactive(trained, data=swapped_data)
    assert status == 1 and err.startswith("fairseq-interactive: error:")
    _one_mismatch_line(err, swapped_data, ckpt)
    common = [
        "--path",
        ckpt,
        "--cpu",
        "--gen-subset",
        "valid",
        "--tokens-per-sample",
        "32",
        "--batch-size",
        "8",
        "--num-workers",
        "0",
    ]
    for name, main in (("fairseq-generate", generate.cli_main), ("fairseq-eval-lm", eval_lm.cli_main)):
        status, _, err = console_in_process(name, main, list(map(str, [swapped_data, *common])))
        assert status == 1 and err.startswith(f"{name}: error:"), err
        _one_mismatch_line(err, swapped_data, ckpt)
    from fairseq.checkpoint.io import CheckpointError
    from fairseq.export import hf
    from fairseq.models.transformer_lm import TransformerLanguageModel

    with pytest.raises(CheckpointError, match="both have"):
        TransformerLanguageModel.from_pretrained(
            str(ckpt.parent), "checkpoint_last.pt", data_name_or_path=str(swapped_data)
        )
    with pytest.raises(CheckpointError, match="both have"):
        hf.export(
            str(ckpt), str(trained["root"] / "hf_swapped"), dict_path=str(swapped_data / "dict.txt"), tokenizer=False
        )


def test_resuming_or_finetuning_with_another_dictionary_is_refused(trained, swapped_data, tmp_path):
    ckpt = trained["ckpt"]
    for flag in ("--restore-file", "--finetune-from-model"):
        argv = tiny_train_argv(
            swapped_data,
            tmp_path / flag,
            "--disable-validation",
            flag,
            str(ckpt),
            max_update=4,
            arch="transformer_lm_gpt",
            json_log=False,
            log_file=False,
        )
        status, _, err = train_in_process(argv)
        assert status == 1 and err.startswith("fairseq-train: error:"), err
        _one_mismatch_line(err, swapped_data, ckpt)


# ------------------------------------------------------------------------------------------ item 8


def test_a_missing_tokenizer_file_is_one_line_at_start_up(trained, tmp_path, monkeypatch):
    from fairseq.models.transformer_lm import TransformerLanguageModel

    monkeypatch.chdir(tmp_path)
    missing = [
        "--bpe",
        "gpt2",
        "--gpt2-encoder-json",
        "nope/encoder.json",
        "--gpt2-vocab-bpe",
        str(trained["keep"] / "vocab.bpe"),
    ]
    status, out, err = train_in_process(
        tiny_train_argv(
            trained["data"],
            tmp_path / "ck",
            *missing,
            max_update=2,
            arch="transformer_lm_gpt",
            json_log=False,
            log_file=False,
        )
    )
    assert status == 1 and err.strip() == (
        f"fairseq-train: error: --gpt2-encoder-json nope/encoder.json: no such "
        f"file (relative paths are read from {tmp_path}); pass the file the data "
        "was encoded with"
    )
    assert not (tmp_path / "ck").exists()  # nothing trained, nothing saved
    common = [trained["data"], "--path", trained["ckpt"], "--cpu", "--gen-subset", "valid", *missing]
    for name, main in (("fairseq-generate", generate.cli_main), ("fairseq-eval-lm", eval_lm.cli_main)):
        status, _, err = console_in_process(name, main, list(map(str, common)))
        assert status == 1 and err.strip().splitlines() == [
            f"{name}: error: --gpt2-encoder-json nope/encoder.json: no such file (relative paths are read from "
            f"{tmp_path}); pass the file the data was encoded with"
        ], err
    status, _, err = _interactive(trained, *missing)
    assert status == 1 and "--gpt2-encoder-json nope/encoder.json: no such file" in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(FileNotFoundError, match="--gpt2-encoder-json nope/encoder.json: no such file"):
        TransformerLanguageModel.from_pretrained(
            str(trained["ckpt"].parent),
            "checkpoint_last.pt",
            data_name_or_path=str(trained["data"]),
            bpe="gpt2",
            gpt2_encoder_json="nope/encoder.json",
        )


@pytest.mark.parametrize(
    "option,content,problem",
    [
        (
            "--gpt2-encoder-json",
            "{not json\n",
            "not a usable GPT-2 BPE encoder.json: not valid JSON (Expecting property "
            "name enclosed in double quotes: line 1 column 2 (char 1))",
        ),
        ("--gpt2-encoder-json", "", "not a usable GPT-2 BPE encoder.json: empty"),
        (
            "--gpt2-vocab-bpe",
            "{not json\n",
            "not a usable GPT-2 BPE vocab.bpe: does not start with a '#version: 0.2' line (got '{not json')",
        ),
        (
            "--sentencepiece-model",
            "{not json\n",
            "not a usable sentencepiece .model file: sentencepiece cannot load it "
            "(INTERNAL: could not parse ModelProto from bad); a .model file written "
            "by spm_train is needed, not the .vocab",
        ),
    ],
)
def test_a_garbage_or_empty_tokenizer_file_is_one_line_at_start_up(
    trained, tmp_path, monkeypatch, option, content, problem
):
    """Every checkpoint would carry the file, and every consumer would then fail on it: refused before training."""
    if option == "--sentencepiece-model":
        pytest.importorskip("sentencepiece")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad").write_text(content)
    keep = trained["keep"]
    flags = {
        "--gpt2-encoder-json": [
            "--bpe",
            "gpt2",
            "--gpt2-encoder-json",
            "bad",
            "--gpt2-vocab-bpe",
            str(keep / "vocab.bpe"),
        ],
        "--gpt2-vocab-bpe": [
            "--bpe",
            "gpt2",
            "--gpt2-encoder-json",
            str(keep / "encoder.json"),
            "--gpt2-vocab-bpe",
            "bad",
        ],
        "--sentencepiece-model": ["--bpe", "sentencepiece", "--sentencepiece-model", "bad"],
    }[option]
    status, out, err = train_in_process(
        tiny_train_argv(
            trained["data"],
            tmp_path / "ck",
            *flags,
            max_update=2,
            arch="transformer_lm_gpt",
            json_log=False,
            log_file=False,
        )
    )
    kind = problem.split(": ")[0].replace("not a usable ", "")
    assert status == 2 and len(err.strip().splitlines()) == 1  # a usage error (the parser's prog name)
    assert err.strip().split(": error: ", 1)[1] == f"{option} bad: {problem}; pass the {kind} the data was encoded with"
    assert not (tmp_path / "ck").exists()  # nothing trained, nothing saved


def test_a_checkpoint_carrying_a_bad_tokenizer_file_says_so_and_how_to_override(trained, tmp_path, monkeypatch):
    """A checkpoint written before the start-up check (or edited) carries garbage: its consumers name the
    checkpoint and the flags that override its copy, and those flags work."""
    from fairseq.models.transformer_lm import TransformerLanguageModel

    state = torch.load(trained["ckpt"], weights_only=True)
    files = state["vocabulary"]["bpe"]["files"]
    files["gpt2_encoder_json"]["content"] = b"{not json\n"
    bad = tmp_path / "bad.pt"
    torch.save(state, bad)
    monkeypatch.chdir(tmp_path)
    said = (
        f"{bad} carries a bad --gpt2-encoder-json file (encoder.json, from "
        f"{files['gpt2_encoder_json']['path']} at training: not valid JSON (Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1))), so its copy cannot be used; override it: pass "
    )
    flags = (
        "--bpe gpt2 --gpt2-encoder-json PATH --gpt2-vocab-bpe PATH (the GPT-2 BPE encoder.json the data was "
        "encoded with)"
    )
    status, _, err = _interactive(trained, path=bad)
    assert status == 1 and err.strip() == f"fairseq-interactive: error: {said}{flags}"
    common = [trained["data"], "--path", bad, "--cpu", "--gen-subset", "valid", "--tokens-per-sample", "32"]
    status, _, err = console_in_process("fairseq-eval-lm", eval_lm.cli_main, list(map(str, common + ["--remove-bpe"])))
    assert status == 1 and err.strip() == f"fairseq-eval-lm: error: {said}{flags}"
    with pytest.raises(
        ValueError,
        match="carries a bad --gpt2-encoder-json file .* override it: pass bpe='gpt2', "
        "gpt2_encoder_json=PATH, gpt2_vocab_bpe=PATH",
    ):
        TransformerLanguageModel.from_pretrained(str(tmp_path), "bad.pt", data_name_or_path=str(trained["data"]))
    status, out, err = _interactive(trained, *_explicit(trained), path=bad)  # the override works
    assert status == 0, err
    assert _lines(out, "D")[0].split("\t")[2].startswith(PROMPT)


def test_the_hydra_bpe_group_is_checked_at_start_up_too(trained, tmp_path, monkeypatch):
    from fairseq_cli import hydra_train
    from tests.integration.test_hydra_train import hydra_args

    monkeypatch.chdir(tmp_path)
    bpe = "++bpe={_name:gpt2,gpt2_encoder_json:nope/encoder.json,gpt2_vocab_bpe:nope/vocab.bpe}"
    status, _, err = console_in_process(
        "fairseq-hydra-train",
        hydra_train.cli_main,
        hydra_args(
            f"task.data={trained['data']}", "checkpoint.save_dir=ck", "hydra.run.dir=.", "hydra/job_logging=none", bpe
        ),
    )
    assert status == 1 and err.strip() == (
        f"fairseq-hydra-train: error: --gpt2-encoder-json {tmp_path}/nope/encoder.json: no such file (relative "
        f"paths are read from {tmp_path}); pass the file the data was encoded with"
    )
    assert not (tmp_path / "ck").exists()


# ------------------------------------------------------------------------------------------ older checkpoints


def test_checkpoints_that_hold_only_paths(trained, tmp_path, monkeypatch):
    """Upstream's and older checkpoints: the saved paths are used as they are (relative to the working
    directory); a missing one is one line naming it and the flags to pass."""
    state = torch.load(trained["ckpt"], weights_only=True)
    del state["vocabulary"]
    old = tmp_path / "old.pt"
    torch.save(state, old)
    monkeypatch.chdir(tmp_path)
    status, _, err = _interactive(trained, path=old)
    assert status == 1 and err.strip() == (
        f"fairseq-interactive: error: {old} was trained with --bpe gpt2 and --gpt2-encoder-json "
        f"gpt2_bpe/encoder.json, which is not found from {tmp_path} (the checkpoint stores its path, not the "
        "file); pass --bpe gpt2 --gpt2-encoder-json PATH --gpt2-vocab-bpe PATH"
    )
    from fairseq.models.transformer_lm import TransformerLanguageModel

    shutil.copytree(trained["keep"], tmp_path / "gpt2_bpe")  # the paths resolve again from here
    status, out, err = _interactive(trained, path=old)
    assert status == 0, err
    assert "<unk>" not in _lines(out, "S")[0]
    lm = TransformerLanguageModel.from_pretrained(str(tmp_path), "old.pt", data_name_or_path=str(trained["data"]))
    assert lm.decode(lm.encode(PROMPT)) == PROMPT


# ------------------------------------------------------------------------------------------ sharded


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_checkpoint_with_sentencepiece_and_its_consolidation(tmp_path, monkeypatch):
    pytest.importorskip("sentencepiece")
    from fairseq.checkpoint.consolidate import consolidate
    from fairseq.checkpoint.sharded import read_metadata
    from fairseq.models.transformer_lm import TransformerLanguageModel

    a = tmp_path / "A"
    a.mkdir()
    model_path = train_spm_model(a, vocab_size=120)
    _corpus(a, n_train=150)
    monkeypatch.chdir(a)
    flags = ["--bpe", "sentencepiece", "--sentencepiece-model", "spm.model"]
    preprocess.cli_main(
        [
            "--only-source",
            "--trainpref",
            "train.txt",
            "--validpref",
            "valid.txt",
            "--destdir",
            "data-bin",
            "--workers",
            "1",
            *flags,
        ]
    )
    _train(a, "data-bin", "ck", "--ddp-backend", "fully_sharded", "--use-sharded-state", *flags)
    content = model_path.read_bytes()
    os.remove(model_path)
    b = tmp_path / "B"
    b.mkdir()
    monkeypatch.chdir(b)
    sharded_dir = a / "ck" / "checkpoint_last"
    assert read_metadata(str(sharded_dir))["vocabulary"]["bpe"]["files"]["sentencepiece_model"]["content"] == content
    consolidate(str(sharded_dir), str(b / "model.pt"), include_optimizer=False)
    assert torch.load(b / "model.pt", weights_only=True)["vocabulary"]["bpe"]["_name"] == "sentencepiece"
    for directory, name in ((a / "ck", "checkpoint_last"), (b, "model.pt")):
        lm = TransformerLanguageModel.from_pretrained(str(directory), name, data_name_or_path=str(a / "data-bin"))
        ids = lm.encode(PROMPT)
        assert lm.src_dict.unk() not in ids.tolist() and lm.decode(ids) == PROMPT
