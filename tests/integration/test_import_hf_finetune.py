"""Fine-tuning an imported OPT, as docs/finetune_opt.md does it: fairseq-preprocess with the imported --bpe files
and dict.txt, fairseq-train --finetune-from-model with the imported model_flags.txt (one process, and fully sharded
on 2 gloo processes), then the fine-tuned checkpoint exported and loaded in transformers, which computes its
logits. The tiny model is OPT-350m's kind (post-norm, word_embed_proj_dim projections, tied)."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from fairseq.data.dictionary import Dictionary  # noqa: E402
from fairseq.export import hf, hf_import  # noqa: E402
from tests.hf_fixtures import tiny_hf_model, write_opt_tokenizer  # noqa: E402
from tests.integration.test_export_hf import assert_same_logits, fork_model, load_hf, random_rows  # noqa: E402
from tests.text_fixtures import sample_text  # noqa: E402
from tests.train_fixtures import train_in_process  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{"fs": the imported directory, "data": data-bin made with its files, "source": the transformers one}."""
    from fairseq_cli import preprocess

    root = tmp_path_factory.mktemp("finetune_opt")
    ids = write_opt_tokenizer(root / "tokenizer")
    source = tiny_hf_model(
        root / "hf", "opt", root / "tokenizer", ids, do_layer_norm_before=False, word_embed_proj_dim=16
    )
    fs = root / "fs"
    hf_import.import_hf(str(source), str(fs))
    lines = [line.strip() for line in sample_text().split("\n") if line.strip()]
    (root / "train.txt").write_text("\n".join(lines[:300]) + "\n", encoding="utf-8")
    (root / "valid.txt").write_text("\n".join(lines[300:340]) + "\n", encoding="utf-8")
    data = root / "data-bin"
    preprocess.cli_main(
        [
            "--only-source",
            "--srcdict",
            str(fs / "dict.txt"),
            "--trainpref",
            str(root / "train.txt"),
            "--validpref",
            str(root / "valid.txt"),
            "--destdir",
            str(data),
            "--workers",
            "1",
            "--bpe",
            "gpt2",
            "--gpt2-encoder-json",
            str(fs / "encoder.json"),
            "--gpt2-vocab-bpe",
            str(fs / "vocab.bpe"),
        ]
    )
    return {"fs": fs, "data": data, "source": source}


def finetune_argv(imported, save_dir, *extra):
    fs = imported["fs"]
    flags = (fs / "model_flags.txt").read_text().split()
    bpe = ["--bpe", "gpt2", "--gpt2-encoder-json", str(fs / "encoder.json"), "--gpt2-vocab-bpe", str(fs / "vocab.bpe")]
    return [
        "--task",
        "language_modeling",
        str(imported["data"]),
        "--save-dir",
        str(save_dir),
        *flags,
        *bpe,
        "--finetune-from-model",
        str(imported["fs"] / "checkpoint_best.pt"),
        "--optimizer",
        "adam",
        "--lr",
        "0.001",
        "--tokens-per-sample",
        "32",
        "--batch-size",
        "4",
        "--max-update",
        "3",
        "--num-workers",
        "0",
        "--cpu",
        "--seed",
        "1",
        "--disable-validation",
        "--dropout",
        "0",
        *extra,
    ]


def check_finetuned(imported, checkpoint, tmp_path):
    """The fine-tuned model: the imported one's options and shapes, its weights moved; exported, transformers
    computes its logits."""
    before = torch.load(imported["fs"] / "checkpoint_best.pt", weights_only=True)
    after = torch.load(checkpoint, weights_only=True)
    from fairseq.models.transformer_lm import TransformerLanguageModel

    for option in TransformerLanguageModel.architecture_options + ("share_decoder_input_output_embed",):
        assert after["cfg"]["model"][option] == before["cfg"]["model"][option], option
    moved = [
        k
        for k, v in before["model"].items()
        if v.is_floating_point() and v.numel() > 1 and not torch.equal(v, after["model"][k].to(v.dtype))
    ]
    assert len(moved) > len(before["model"]) // 2
    assert after["vocabulary"]["dictionary_sha256"] == before["vocabulary"]["dictionary_sha256"]
    out = tmp_path / "hf_finetuned"
    result = hf.export(str(checkpoint), str(out), dict_path=str(imported["fs"] / "dict.txt"))
    assert result["architecture"] == "OPTForCausalLM" and result["tokenizer"] == "gpt2"
    dictionary = Dictionary.load(str(imported["fs"] / "dict.txt"))
    model = load_hf(out)
    assert model.config.word_embed_proj_dim == 16 and model.config.do_layer_norm_before is False
    assert_same_logits(fork_model(checkpoint, dictionary), model, random_rows(len(dictionary), [30, 12, 5]))
    # The tokenizer of the export is transformers' OPT tokenizer's ids again.
    text = "Fine-tuned: naïve  text 🙂"
    original = transformers.AutoTokenizer.from_pretrained(str(imported["source"]))
    assert transformers.AutoTokenizer.from_pretrained(str(out))(text).input_ids == original(text).input_ids


def test_finetune_one_process_then_export(imported, tmp_path):
    from fairseq_cli import train

    train.cli_main(finetune_argv(imported, tmp_path / "ck"))
    check_finetuned(imported, tmp_path / "ck" / "checkpoint_last.pt", tmp_path)


def test_the_printed_command_runs_as_printed(imported, tmp_path, capsys):
    """scripts/import_hf.py's fine-tuning command, for this model of 64 positions (fewer than fairseq-train's
    default blocks of 1024), with DATA given and nothing else but where to save, how long and the CPU: it trains."""
    import importlib.util
    import shlex

    from fairseq.utils import run_console_script
    from fairseq_cli import train

    spec = importlib.util.spec_from_file_location("import_hf_script", os.path.join(ROOT, "scripts", "import_hf.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "fs"
    run_console_script("import_hf", script.main, [str(imported["source"]), str(out)])
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "fine-tune with: " in line]
    command = shlex.split(line.split("fine-tune with: ", 1)[1])
    assert command[:2] == ["fairseq-train", "DATA"] and "--tokens-per-sample 64" in " ".join(command)
    assert (out / "model_flags.txt").read_text().split()[-4:] == [
        "--max-target-positions",
        "64",
        "--tokens-per-sample",
        "64",
    ]
    train.cli_main(
        [str(imported["data"])]
        + command[2:]
        + ["--save-dir", str(tmp_path / "ck"), "--max-update", "1", "--cpu", "--num-workers", "0"]
    )
    state = torch.load(tmp_path / "ck" / "checkpoint_last.pt", weights_only=True)
    assert state["extra_state"]["trainer"]["num_updates"] == 1


def test_finetune_fully_sharded_on_two_processes_then_export(imported, tmp_path):
    log = tmp_path / "train.log"  # the ranks' log
    argv = finetune_argv(imported, tmp_path / "ck", "--ddp-backend", "fully_sharded", "--distributed-world-size", "2")
    status, out, err = train_in_process(argv + ["--log-file", str(log)])  # the 2 ranks spawned from this process
    assert status == 0, out[-3000:] + err[-3000:]
    assert "--finetune-from-model" in log.read_text() or "loaded model weights" in log.read_text()
    check_finetuned(imported, tmp_path / "ck" / "checkpoint_last.pt", tmp_path)
