"""scripts/import_hf.py / fairseq.export.hf_import: a transformers OPT or XGLM directory as a checkpoint of this fork.

Tiny random models made with transformers' own config classes (tests/hf_fixtures.py: OPT pre- and post-norm, with
and without word_embed_proj_dim projections, tied and untied, without the final layer norm, without biases or
norm affines; XGLM tied and scaled, untied and unscaled; bf16 sharded safetensors, pytorch_model.bin) are
imported; the fork's model computes transformers' logits (fp32, atol 1e-4) and greedy tokens; exporting the import
gives back the original tensors bit for bit; importing an export gives back the checkpoint's weights bit for bit;
the fork's --bpe on the imported files gives transformers' ids on tricky text; from_pretrained loads a
transformers directory; bad input is refused in one line naming the file.
"""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from fairseq.data.dictionary import Dictionary  # noqa: E402
from fairseq.export import hf, hf_import  # noqa: E402
from fairseq.export.safetensors_shards import read_weights  # noqa: E402
from tests.hf_fixtures import tiny_hf_model, write_opt_tokenizer, write_xglm_tokenizer  # noqa: E402
from tests.integration.test_export_hf import (  # noqa: E402
    EXTRA_TEXT,
    KINDS,
    assert_same_greedy,
    assert_same_logits,
    fork_model,
    load_hf,
    random_rows,
    word_dictionary,
    write_checkpoint,
)
from tests.integration.test_preprocess_bpe import TRICKY  # noqa: E402
from tests.text_fixtures import sample_text, train_gpt2_files, train_spm_model, write_full_gpt2_dict  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """{"opt": (directory, ids), "xglm": (directory, ids)}: the tokenizer files of the tiny models."""
    root = tmp_path_factory.mktemp("hf_tokenizers")
    return {
        "opt": (root / "opt", write_opt_tokenizer(root / "opt")),
        "xglm": (root / "xglm", write_xglm_tokenizer(root / "xglm")),
    }


def make_hf(tmp_path, tokenizers, model_type, **options):
    directory, ids = tokenizers[model_type]
    return tiny_hf_model(tmp_path / "hf", model_type, directory, ids, **options)


def hf_tensors(directory):
    """The weights of a transformers directory under transformers' full names."""
    return hf_import._with_model_prefix(read_weights(str(directory))[0])


# ----------------------------------------------------------------------------- transformers -> fork


VARIANTS = {
    # name: (model type, options); every variant is also exported back and compared bit for bit
    "opt_prenorm_tied": ("opt", {}),
    "opt_postnorm_projections": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 16}),  # OPT-350m's
    "opt_untied_no_final_norm": (
        "opt",
        {
            "tie_word_embeddings": False,
            "_remove_final_layer_norm": True,
            "activation_function": "gelu_new",
            "word_embed_proj_dim": 16,
        },
    ),
    "opt_no_bias_no_affine": ("opt", {"enable_bias": False, "layer_norm_elementwise_affine": False}),
    "opt_bf16_sharded": ("opt", {"dtype": torch.bfloat16, "max_shard_size": "30KB", "tie_word_embeddings": False}),
    "opt_pytorch_bin": ("opt", {"pickle": True}),
    "xglm_tied_scaled_legacy_pytorch_bin": ("xglm", {"pickle": "legacy"}),
    "xglm_untied_unscaled_relu_bf16": (
        "xglm",
        {
            "tie_word_embeddings": False,
            "scale_embedding": False,
            "activation_function": "relu",
            "dtype": torch.bfloat16,
        },
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_imported_model_computes_what_transformers_computes(variant, tokenizers, tmp_path):
    model_type, options = VARIANTS[variant]
    source = make_hf(tmp_path, tokenizers, model_type, **options)
    files = read_weights(str(source))[1]
    assert (
        len(files) > 2
        if "max_shard_size" in options
        else files == (["pytorch_model.bin"] if options.get("pickle") else ["model.safetensors"])
    )
    result = hf_import.import_hf(str(source), str(tmp_path / "fs"))
    assert result["architecture"] == ("OPTForCausalLM" if model_type == "opt" else "XGLMForCausalLM")
    assert result["bpe"] == ("gpt2" if model_type == "opt" else "sentencepiece")
    state = torch.load(result["checkpoint"], weights_only=True)
    _assert_flags_build(tmp_path / "fs" / "model_flags.txt", state["cfg"]["model"])
    dtype = options.get("dtype", torch.float32)
    assert state["model"]["decoder.embed_tokens.weight"].dtype == dtype  # stored as it was
    dictionary = Dictionary.load(str(tmp_path / "fs" / "dict.txt"))
    fork = fork_model(result["checkpoint"], dictionary).float()
    theirs = load_hf(source)
    rows = random_rows(len(dictionary), [30, 17, 9, 1])
    assert_same_logits(fork, theirs, rows)
    assert_same_greedy(fork, theirs, [r[:n] for r, n in zip(rows, (7, 4, 1))])

    # export(import(hf)): transformers' tensors again, bit for bit (the zero biases and unit scales the fork
    # needs in place of enable_bias / elementwise_affine = false come out as such). XGLM's unigram sentencepiece
    # model has no exact transformers tokenizer (the export refuses it): the model alone.
    hf.export(result["checkpoint"], str(tmp_path / "back"), tokenizer=model_type == "opt")
    original, back = hf_tensors(source), hf_tensors(tmp_path / "back")
    for name, tensor in back.items():
        if name in original:
            assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name
        else:
            assert not options.get("enable_bias", True) and (tensor == (1 if name.endswith("norm.weight") else 0)).all()
    assert set(original) - {"lm_head.weight"} <= set(back)
    config, back_config = (json.loads((d / "config.json").read_text()) for d in (source, tmp_path / "back"))
    for key in (
        "hidden_size",
        "d_model",
        "num_hidden_layers",
        "num_layers",
        "ffn_dim",
        "word_embed_proj_dim",
        "do_layer_norm_before",
        "_remove_final_layer_norm",
        "scale_embedding",
        "tie_word_embeddings",
    ):
        assert config.get(key) == back_config.get(key) or key not in config, key


def _assert_flags_build(flags_file, model_cfg):
    """fairseq-train's parser builds the imported model's options from model_flags.txt."""
    from fairseq import options
    from fairseq.models.transformer_lm import TransformerLanguageModel

    args = options.parse_args_and_arch(options.get_training_parser(), ["data"] + flags_file.read_text().split())
    for option in TransformerLanguageModel.architecture_options + ("share_decoder_input_output_embed", "dropout"):
        assert getattr(args, option) == model_cfg[option], option


def test_bf16_to_float32_and_the_cli(tokenizers, tmp_path, capsys):
    """--dtype casts; the script prints the fine-tuning command, model_flags.txt holds its model flags."""
    from fairseq.utils import run_console_script

    source = make_hf(tmp_path, tokenizers, "opt", dtype=torch.bfloat16)
    script = _script()
    run_console_script("import_hf", script.main, [str(source), str(tmp_path / "fs"), "--dtype", "float32"])
    out = capsys.readouterr().out
    flags = (tmp_path / "fs" / "model_flags.txt").read_text().split()
    assert f"--finetune-from-model {tmp_path / 'fs' / 'checkpoint_best.pt'}" in out and " ".join(flags) in out
    assert flags[:2] == ["--arch", "transformer_lm"] and "--no-scale-embedding" in flags
    state = torch.load(tmp_path / "fs" / "checkpoint_best.pt", weights_only=True)["model"]
    assert {v.dtype for v in state.values()} == {torch.float32}
    original = hf_tensors(source)["model.decoder.layers.1.fc2.weight"]
    assert torch.equal(state["decoder.layers.1.fc2.weight"], original.float())
    assert sorted(os.listdir(tmp_path / "fs")) == [
        "checkpoint_best.pt",
        "dict.txt",
        "encoder.json",
        "fairseq_manifest.json",
        "model_flags.txt",
        "vocab.bpe",
    ]


# ----------------------------------------------------------------------------- the tokenizers


def _texts():
    return sample_text().split("\n")[:1500] + TRICKY.split("\n") + [TRICKY] + EXTRA_TEXT


def test_opt_tokenizer_gives_transformers_ids(tokenizers, tmp_path):
    from fairseq.data.encoders.gpt2_bpe import GPT2BPE, GPT2BPEConfig

    source = make_hf(tmp_path, tokenizers, "opt")
    out = tmp_path / "fs"
    hf_import.import_hf(str(source), str(out))
    theirs = transformers.AutoTokenizer.from_pretrained(str(source))
    bpe = GPT2BPE(GPT2BPEConfig(gpt2_encoder_json=str(out / "encoder.json"), gpt2_vocab_bpe=str(out / "vocab.bpe")))
    dictionary = Dictionary.load(str(out / "dict.txt"))
    for text in _texts():
        ours = dictionary.encode_line(bpe.encode(text), append_eos=False).tolist()
        # transformers matches its special tokens' text (a literal "</s>") as those tokens, fairseq never does;
        # with split_special_tokens it reads them as text too.
        literal = any(s in text for s in ("<s>", "</s>", "<pad>", "<unk>"))
        assert theirs(text, add_special_tokens=False, split_special_tokens=literal).input_ids == ours, repr(text)
    assert theirs("hi").input_ids[0] == 2  # OPT starts from </s>, as fairseq


def test_xglm_tokenizer_gives_transformers_ids(tokenizers, tmp_path):
    """sentencepiece (what XGLM was trained with, and what the fork runs) against transformers' XGLM tokenizer,
    a `tokenizers` Unigram. They agree but where transformers differs from sentencepiece: text that ends in
    whitespace (sentencepiece drops it, transformers keeps a last "▁"; fairseq's data scripts strip every line)
    and runs of one character (equally scored segmentations: the Unigram breaks the tie otherwise); and where
    fairseq differs from both: a whitespace character the model does not know (U+0085, U+2028: sentencepiece
    passes it through as a piece, fairseq splits the pieces on whitespace, so it vanishes) and a special token's
    spelling in the text ("</s>": transformers' Unigram holds the specials as pieces, even with
    split_special_tokens). The rest is compared."""
    from fairseq.data.encoders.sentencepiece_bpe import SentencepieceBPE, SentencepieceConfig

    source = make_hf(tmp_path, tokenizers, "xglm")
    out = tmp_path / "fs"
    hf_import.import_hf(str(source), str(out))
    theirs = transformers.AutoTokenizer.from_pretrained(str(source))
    bpe = SentencepieceBPE(SentencepieceConfig(sentencepiece_model=str(out / "sentencepiece.bpe.model")))
    dictionary = Dictionary.load(str(out / "dict.txt"))
    left_out = 0
    for text in _texts():
        if (
            any(c * 4 in text for c in set(text) - {" "})
            or any(s in text for s in ("<s>", "</s>", "<pad>", "<unk>"))
            or any(c.isspace() and c not in " \t\n\r\x0b\x0c\u3000\xa0" for c in text)
        ):
            left_out += 1
            continue
        ours = dictionary.encode_line(bpe.encode(text), append_eos=False).tolist()
        assert theirs(text.rstrip(), add_special_tokens=False).input_ids == ours, repr(text)
    assert left_out < 50  # of 1,500 lines
    assert theirs("hi").input_ids[0] == 2  # XGLM starts from </s>, as fairseq


# ----------------------------------------------------------------------------- fork -> transformers -> fork


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_import_of_an_export_is_the_checkpoint(kind, tmp_path):
    arch, options, _ = KINDS[kind]
    ckpt = write_checkpoint(tmp_path / "ck", word_dictionary(), arch=arch, **options)
    hf.export(ckpt, str(tmp_path / "hf"))
    hf_import.import_hf(str(tmp_path / "hf"), str(tmp_path / "fs"))
    _assert_same_checkpoint(ckpt, tmp_path / "fs" / "checkpoint_best.pt")
    assert (tmp_path / "fs" / "dict.txt").read_bytes() == (tmp_path / "ck" / "dict.txt").read_bytes()
    assert not (tmp_path / "fs" / "encoder.json").exists()  # trained without --bpe: none comes back


def test_import_of_an_export_keeps_the_bpe_files(tmp_path):
    """GPT-2 (a dict.txt of every GPT-2 id, shuffled, as GPT-2's own) and sentencepiece checkpoints: the files come
    back byte for byte; an export from before exports carried them (tokenizer.json + dict.txt only) gives an
    encoder.json of the same ids."""
    enc, vocab = train_gpt2_files(tmp_path, sample_text()[:200000], vocab_size=500)
    write_full_gpt2_dict(enc, tmp_path / "gpt2_dict.txt")
    gpt2 = Dictionary.load(str(tmp_path / "gpt2_dict.txt"))
    ckpt = write_checkpoint(tmp_path / "gpt2", gpt2, arch="transformer_lm_gpt3_small")
    hf.export(
        ckpt, str(tmp_path / "hf"), bpe={"_name": "gpt2", "gpt2_encoder_json": str(enc), "gpt2_vocab_bpe": str(vocab)}
    )
    hf_import.import_hf(str(tmp_path / "hf"), str(tmp_path / "fs"))
    _assert_same_checkpoint(ckpt, tmp_path / "fs" / "checkpoint_best.pt")
    for name, original in (("encoder.json", enc), ("vocab.bpe", vocab), ("dict.txt", tmp_path / "gpt2_dict.txt")):
        assert (tmp_path / "fs" / name).read_bytes() == original.read_bytes(), name
    for name in ("encoder.json", "vocab.bpe"):
        (tmp_path / "hf" / name).unlink()
    hf_import.import_hf(str(tmp_path / "hf"), str(tmp_path / "fs"), overwrite=True)
    assert json.loads((tmp_path / "fs" / "encoder.json").read_text()) == json.loads(enc.read_text())

    model = train_spm_model(tmp_path)
    pieces = [line.split("\t")[0] for line in (tmp_path / "spm.vocab").read_text().splitlines()[3:]]
    spm_dict = Dictionary()
    for piece in pieces:
        spm_dict.add_symbol(piece, 100)
    spm_dict.pad_to_multiple_(8)
    ckpt = write_checkpoint(tmp_path / "spm", spm_dict, arch="transformer_lm_gpt")
    hf.export(ckpt, str(tmp_path / "hf_spm"), bpe={"_name": "sentencepiece", "sentencepiece_model": str(model)})
    hf_import.import_hf(str(tmp_path / "hf_spm"), str(tmp_path / "fs_spm"))
    _assert_same_checkpoint(ckpt, tmp_path / "fs_spm" / "checkpoint_best.pt")
    assert (tmp_path / "fs_spm" / "sentencepiece.bpe.model").read_bytes() == model.read_bytes()


def _assert_same_checkpoint(original, imported):
    a, b = (torch.load(p, weights_only=True) for p in (original, imported))
    assert list(a["model"]) == list(b["model"])
    for key, tensor in a["model"].items():
        assert tensor.dtype == b["model"][key].dtype and torch.equal(tensor, b["model"][key]), key
    from fairseq.models.transformer_lm import TransformerLanguageModel

    for option in TransformerLanguageModel.architecture_options + ("share_decoder_input_output_embed",):
        assert a["cfg"]["model"][option] == b["cfg"]["model"][option], option


# ----------------------------------------------------------------------------- from_pretrained


@pytest.mark.parametrize("model_type", ["opt", "xglm"])
def test_from_pretrained_on_a_transformers_directory(model_type, tokenizers, tmp_path):
    from fairseq.models.transformer_lm import TransformerLanguageModel

    options = {"do_layer_norm_before": False, "word_embed_proj_dim": 16} if model_type == "opt" else {}
    source = make_hf(tmp_path, tokenizers, model_type, **options)
    lm = TransformerLanguageModel.from_pretrained(str(source))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source))
    theirs = load_hf(source)
    prompt = "The grammar of  naïve 🙂"
    ids = tokenizer(prompt).input_ids
    assert lm.encode(prompt).tolist() == ids[1:] + [2]  # fairseq's encode ends with </s>; transformers starts with it
    new = 6
    out = theirs.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)[0, len(ids) :]
    hypo = lm.generate([lm.encode(prompt)[:-1]], beam=1, max_len_b=len(ids) - 1 + new, min_len=len(ids) - 1 + new)
    assert hypo[0][0]["tokens"][len(ids) - 1 : len(ids) - 1 + new].tolist() == out.tolist()


def test_path_to_a_transformers_directory_says_how_to_load_it(tiny_data, tmp_path, monkeypatch):
    """--path of fairseq-interactive, -generate, -eval-lm at a transformers directory (or a file of one): one line
    naming scripts/import_hf.py and from_pretrained."""
    import io

    from fairseq_cli import eval_lm, generate, interactive
    from tests.train_fixtures import console_in_process

    source = tmp_path / "hf"
    hf.export(write_checkpoint(tmp_path / "ck", word_dictionary(), arch="transformer_lm_gpt"), str(source))
    monkeypatch.setattr("sys.stdin", io.StringIO("w1 w2\n"))
    for name, cli_main, path, part in (
        ("fairseq-interactive", interactive.cli_main, source, ""),
        ("fairseq-generate", generate.cli_main, source / "model.safetensors", "a file of "),
        ("fairseq-eval-lm", eval_lm.cli_main, source / "config.json", "a file of "),
    ):
        status, _, err = console_in_process(name, cli_main, [str(tiny_data), "--path", str(path), "--cpu"])
        assert status == 1 and err.strip() == (
            f"{name}: error: {path} is {part}a transformers model directory (config.json of model_type xglm), not a "
            f"fairseq checkpoint: import it with `python scripts/import_hf.py {source} OUT_DIR` and pass --path "
            f"OUT_DIR/checkpoint_best.pt, or load it in Python with TransformerLanguageModel.from_pretrained("
            f"{str(source)!r})"
        ), err


# ----------------------------------------------------------------------------- bad input


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "import_hf_script", os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "import_hf.py")
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _break(case, source):
    """Damage the tiny OPT directory `source` as `case` says; returns the file the message must name."""
    if case == "llama":
        (source / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
        return source / "config.json"
    if case == "no_tokenizer":
        for name in ("vocab.json", "merges.txt"):
            (source / name).unlink()
        return source
    if case in ("vocab_bigger_than_rows", "rows_far_more_than_vocab"):
        vocab = json.loads((source / "vocab.json").read_text())
        extra = 40 if case == "vocab_bigger_than_rows" else -200
        if extra > 0:
            vocab.update({f"<extra{i}>": len(vocab) + i for i in range(extra)})
        else:
            vocab = {t: i for t, i in vocab.items() if i < len(vocab) + extra}
        (source / "vocab.json").write_text(json.dumps(vocab))
        return source / "vocab.json"
    if case in CONFIG_VALUES:
        config = json.loads((source / "config.json").read_text())
        config.update(CONFIG_VALUES[case])
        (source / "config.json").write_text(json.dumps(config))
        return source / "config.json"
    if case == "shared_id":
        vocab = json.loads((source / "vocab.json").read_text())
        del vocab[{i: t for t, i in vocab.items()}[10]]
        vocab.update(dup_a=10, dup_b=10)  # two tokens of id 10
        (source / "vocab.json").write_text(json.dumps(vocab))
        return source / "vocab.json"
    if case.startswith("index_"):  # a shard moved out of the directory, the index naming it there
        index = json.loads((source / "model.safetensors.index.json").read_text())
        shard = sorted(set(index["weight_map"].values()))[-1]
        outside = source.parent / "elsewhere.safetensors"
        (source / shard).rename(outside)
        name = "../elsewhere.safetensors" if case == "index_parent" else str(outside)
        index["weight_map"] = {k: name if v == shard else v for k, v in index["weight_map"].items()}
        (source / "model.safetensors.index.json").write_text(json.dumps(index))
        return source / "model.safetensors.index.json"
    if case == "no_weights":
        (source / "model.safetensors").unlink()
        return source
    if case == "pickled_objects":
        (source / "model.safetensors").unlink()
        torch.save({"model": object.__new__(Dictionary)}, str(source / "pytorch_model.bin"))
        return source / "pytorch_model.bin"
    raise AssertionError(case)


CONFIG_VALUES = {  # case: config.json values of the wrong kind
    "hidden_size_string": {"hidden_size": "64"},
    "hidden_size_float": {"hidden_size": 2.5},
    "hidden_size_null": {"hidden_size": None},
    "hidden_size_abc": {"hidden_size": "abc"},
    "layers_negative": {"num_hidden_layers": -1},
    "dropout_switch": {"dropout": True},
}

BAD = {  # case: what the one line says (besides the file's name)
    "hidden_size_string": 'hidden_size is "64" (a string); expected a positive integer',
    "hidden_size_float": "hidden_size is 2.5 (a number); expected a positive integer",
    "hidden_size_null": "hidden_size is null; expected a positive integer",
    "hidden_size_abc": 'hidden_size is "abc" (a string); expected a positive integer',
    "layers_negative": "num_hidden_layers is -1 (an integer); expected an integer >= 0",
    "dropout_switch": "dropout is true (a boolean); expected a number from 0 to below 1",
    "shared_id": "tokens 'dup_a' and 'dup_b' share id 10; each id names one token",
    "index_parent": 'names the weight file "../elsewhere.safetensors", outside ',
    "index_absolute": 'elsewhere.safetensors", outside ',
    "llama": "model_type 'llama' (LlamaForCausalLM) is not OPT or XGLM",
    "no_tokenizer": "has no GPT-2 tokenizer files (vocab.json + merges.txt, or tokenizer.json)",
    "vocab_bigger_than_rows": "entries but the model's embedding has",
    "rows_far_more_than_vocab": "entries but the model's embedding has",
    "no_weights": "holds no weights",
    "pickled_objects": "holds pickled Python objects besides tensors",
}


@pytest.mark.parametrize("case", sorted(BAD) + ["xglm_without_sentencepiece", "output_exists"])
def test_bad_input_is_one_line_naming_the_file(case, tokenizers, tmp_path, capsys):
    from fairseq.utils import run_console_script

    out = tmp_path / "fs"
    if case == "xglm_without_sentencepiece":
        source = make_hf(tmp_path, tokenizers, "xglm")
        (source / "sentencepiece.bpe.model").unlink()
        named, message = source / "sentencepiece.bpe.model", "tokenizer.json alone is not enough"
    elif case == "output_exists":
        source = make_hf(tmp_path, tokenizers, "opt")
        out.mkdir()
        (out / "x").write_text("x")
        named, message = out, "already exists and holds files scripts/import_hf.py did not write"
    else:
        sharded = {"max_shard_size": "30KB"} if case.startswith("index_") else {}
        source = make_hf(tmp_path, tokenizers, "opt", **sharded)
        named, message = _break(case, source), BAD[case]
    capsys.readouterr()  # transformers' progress bars of making the model
    with pytest.raises(SystemExit) as exit_info:
        run_console_script("import_hf", _script().main, [str(source), str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1 and len(err) == 1 and err[0].startswith("import_hf: error: "), err
    assert str(named) in err[0] and message in err[0], err[0]
    assert case == "output_exists" or not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".fs.")]  # nothing half-written left


def test_xglm_start_and_pad_ids_must_be_fairseq_layout(tokenizers, tmp_path):
    source = make_hf(tmp_path, tokenizers, "xglm", pad_token_id=0)
    with pytest.raises(ValueError, match=r"config.json: pad_token_id 0 and eos_token_id 2"):
        hf_import.import_hf(str(source), str(tmp_path / "fs"))
