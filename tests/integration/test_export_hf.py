"""scripts/export_hf.py / fairseq.export.hf: a checkpoint of this fork as a transformers model directory.

Each exported kind (OPT from learned positions; XGLM from sinusoidal pre-norm; OPT with the sinusoidal table or
a zero table written out; OPT with projections and no final norm) is loaded with AutoModelForCausalLM and
compared with the fork's model on a right-padded batch: logits at the real tokens within atol 1e-4 in fp32 (both
compute the same operations on the same fp32 weights; only the order of a few roundings differs: OPT and XGLM
scale q before q.k where SDPA scales the product, and the embedding scale is folded into OPT's matrix; the
observed gap is ~1e-6). Greedy generation by transformers (left-padded batch) equals the argmax loop of the
fork's forward. The tokenizers give the ids that fairseq's --bpe gpt2 / sentencepiece + dict.txt give, on
tricky text. One checkpoint comes from the real fairseq-train (data from fairseq-preprocess --bpe gpt2
--srcdict), one from fairseq-train --use-sharded-state; the others are built here with perturbed weights and
written in the checkpoint file layout. Refusals are one-line errors naming the option.
"""

import importlib.util
import json
import os
import random
import resource
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from fairseq.checkpoint.inference import load_model_weights, read_checkpoint_config  # noqa: E402
from fairseq.checkpoint.io import atomic_torch_save  # noqa: E402
from fairseq.data.dictionary import Dictionary  # noqa: E402
from fairseq.dataclass.utils import config_from_dict, config_to_dict  # noqa: E402
from fairseq.export import hf  # noqa: E402
from fairseq.models.transformer_lm import (  # noqa: E402
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    preset_config,
)
from fairseq.utils import run_console_script  # noqa: E402

from tests.integration.test_preprocess_bpe import TRICKY  # noqa: E402
from tests.text_fixtures import sample_text, train_gpt2_files, train_spm_model, write_full_gpt2_dict  # noqa: E402

ATOL = 1e-4
EXTRA_TEXT = [
    "don't you'll I'M 1234567 3.14",
    "  two  spaces ",
    " \u00a0nbsp\u3000ideographic",
    "🙂🙂 👍🏽 é e\u0301",
    "<|endoftext|> </s> <s> <pad> <unk> madeupword0000",
    "\r\n\r\n",
    "tab\there",
    "x" * 200,
    "form\x0cfeed \u2028 sep \x85 nel",
    "日本語 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "",
]


# ----------------------------------------------------------------------------- helpers


def fork_model(checkpoint, dictionary):
    """The fork's model from `checkpoint` (file or sharded directory), through the project's loaders."""
    saved, state = read_checkpoint_config(str(checkpoint))
    cfg = config_from_dict(TransformerLanguageModelConfig, saved["model"], name=saved["model"]["_name"])
    model = TransformerLanguageModel.build(cfg, len(dictionary), dictionary.pad())
    load_model_weights(model, str(checkpoint), state)
    return model.eval()


def word_dictionary(n=61):
    d = Dictionary()
    for i in range(n):
        d.add_symbol(f"w{i}", n - i)
    d.finalize(padding_factor=8)
    return d


def write_checkpoint(
    directory, dictionary, arch="transformer_lm", seed=0, add_bos_token=False, output_dictionary_size=-1, **options
):
    """A checkpoint file of `arch` with `options`, every parameter perturbed (layer norms too), with dict.txt."""
    os.makedirs(directory, exist_ok=True)
    cfg = preset_config(
        arch,
        decoder_layers=2,
        decoder_embed_dim=32,
        decoder_ffn_embed_dim=48,
        decoder_attention_heads=4,
        tokens_per_sample=24,
        dropout=0.1,
        **options,
    )
    torch.manual_seed(seed)
    model = TransformerLanguageModel.build(
        cfg,
        len(dictionary),
        dictionary.pad(),
        output_vocab_size=(output_dictionary_size if output_dictionary_size >= 0 else None),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    path = os.path.join(directory, "checkpoint_best.pt")
    atomic_torch_save(
        {
            "cfg": {
                "model": config_to_dict(cfg),
                "task": {
                    "_name": "language_modeling",
                    "add_bos_token": add_bos_token,
                    "output_dictionary_size": output_dictionary_size,
                },
            },
            "model": model.state_dict(),
        },
        path,
    )
    dictionary.save(os.path.join(directory, "dict.txt"))
    return path


def right_padded(rows, pad=1):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def random_rows(vocab, lengths, begin=2, seed=0):
    g = random.Random(seed)
    return [[begin] + [g.randrange(4, vocab) for _ in range(n - 1)] for n in lengths]


def load_hf(out):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True, dtype=torch.float32
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@torch.no_grad()
def assert_same_logits(fork, hf_model, rows):
    ids, mask = right_padded(rows)
    ours = fork(ids)[0]
    theirs = hf_model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert theirs.shape == ours.shape
    assert torch.allclose(ours[real], theirs[real], atol=ATOL, rtol=0), (ours[real] - theirs[real]).abs().max()
    # Without a mask (a batch of full rows): the same.
    full = ids[:1, : len(rows[0])]
    assert torch.allclose(fork(full)[0], hf_model(input_ids=full).logits, atol=ATOL, rtol=0)


@torch.no_grad()
def assert_same_greedy(fork, hf_model, rows, steps=5, eos=2):
    """transformers' greedy generate on a left-padded batch equals each row's argmax loop with the fork."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), 1, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, num_beams=1)[
        :, width:
    ]
    for i, r in enumerate(rows):
        seq = torch.tensor([r])
        for _ in range(steps):
            seq = torch.cat([seq, fork(seq)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
        expected = seq[0, len(r) :].tolist()
        if eos in expected:  # transformers stops there (and pads the rest)
            expected = expected[: expected.index(eos) + 1]
        assert out[i, : len(expected)].tolist() == expected, (i, out[i].tolist(), expected)


def fairseq_ids(bpe, dictionary, text):
    return dictionary.encode_line(bpe.encode(text), add_if_not_exist=False, append_eos=False).tolist()


# ----------------------------------------------------------------------------- fairseq-train + GPT-2 BPE


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """fairseq-train on data from fairseq-preprocess --bpe gpt2 --srcdict (a dict.txt listing every GPT-2 id,
    shuffled, as GPT-2's own lists all of them): the tiny GPT-3 preset (learned positions, tied, scaled)."""
    from fairseq_cli import preprocess, train

    root = tmp_path_factory.mktemp("export_gpt2")
    enc, vocab = train_gpt2_files(root, sample_text(), vocab_size=600)
    write_full_gpt2_dict(enc, root / "gpt2_dict.txt")
    lines = [line.strip() for line in sample_text().split("\n") if line.strip()]
    (root / "train.txt").write_text("\n".join(lines[:300]) + "\n", encoding="utf-8")
    (root / "valid.txt").write_text("\n".join(lines[300:340]) + "\n", encoding="utf-8")
    bpe_flags = ["--bpe", "gpt2", "--gpt2-encoder-json", str(enc), "--gpt2-vocab-bpe", str(vocab)]
    data = root / "data-bin"
    preprocess.cli_main(
        [
            "--only-source",
            "--srcdict",
            str(root / "gpt2_dict.txt"),
            "--trainpref",
            str(root / "train.txt"),
            "--validpref",
            str(root / "valid.txt"),
            "--destdir",
            str(data),
            "--workers",
            "1",
            *bpe_flags,
        ]
    )
    save_dir = root / "checkpoints"
    train.cli_main(
        [
            "--task",
            "language_modeling",
            str(data),
            "--save-dir",
            str(save_dir),
            "--arch",
            "transformer_lm_gpt3_small",
            "--decoder-layers",
            "2",
            "--decoder-embed-dim",
            "32",
            "--decoder-attention-heads",
            "2",
            "--optimizer",
            "adam",
            "--lr",
            "0.003",
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
            "3",
            "--disable-validation",
            *bpe_flags,
        ]
    )
    checkpoint = save_dir / "checkpoint_last.pt"
    out = root / "hf"
    result = hf.export(str(checkpoint), str(out), dict_path=str(data / "dict.txt"))  # the BPE: from the checkpoint
    return {"checkpoint": checkpoint, "out": out, "result": result, "data": data, "enc": enc, "vocab": vocab}


def test_opt_from_fairseq_train(gpt2_run):
    out = gpt2_run["out"]
    assert gpt2_run["result"]["architecture"] == "OPTForCausalLM" and gpt2_run["result"]["tokenizer"] == "gpt2"
    assert sorted(os.listdir(out)) == [
        "config.json",
        "dict.txt",
        "encoder.json",
        "fairseq_manifest.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.bpe",
    ]
    assert (out / "encoder.json").read_bytes() == gpt2_run["enc"].read_bytes()  # the --bpe files, for the way back
    config = json.loads((out / "config.json").read_text())
    # GPT-3 presets scale embeddings by sqrt(32): folded into OPT's input matrix, so written untied.
    assert config["tie_word_embeddings"] is False and config["max_position_embeddings"] == 32
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 2, 1)
    dictionary = Dictionary.load(str(gpt2_run["data"] / "dict.txt"))
    fork = fork_model(gpt2_run["checkpoint"], dictionary)
    model = load_hf(out)
    # fairseq's first position row is padding_idx + 1 = 2, OPT's offset is 2: the same table, unchanged.
    state = torch.load(gpt2_run["checkpoint"], weights_only=True)["model"]
    assert torch.equal(model.model.decoder.embed_positions.weight, state["decoder.embed_positions.weight"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    texts = ["The quick brown fox", "Python's grammar: if x == 1: print(x)", "a"]
    rows = [tokenizer(t).input_ids for t in texts]
    assert all(r[0] == 2 for r in rows)
    assert_same_logits(fork, model, rows)
    assert_same_greedy(fork, model, rows)


def test_gpt2_tokenizer_gives_fairseq_ids(gpt2_run):
    from fairseq.data.encoders.gpt2_bpe import GPT2BPE, GPT2BPEConfig

    dictionary = Dictionary.load(str(gpt2_run["data"] / "dict.txt"))
    bpe = GPT2BPE(GPT2BPEConfig(gpt2_encoder_json=str(gpt2_run["enc"]), gpt2_vocab_bpe=str(gpt2_run["vocab"])))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gpt2_run["out"]))
    texts = sample_text().split("\n")[:2000] + TRICKY.split("\n") + [TRICKY] + EXTRA_TEXT
    for text in texts:
        expected = fairseq_ids(bpe, dictionary, text)
        assert tokenizer(text, add_special_tokens=False).input_ids == expected, repr(text)
    assert tokenizer("hello").input_ids == [2] + fairseq_ids(bpe, dictionary, "hello")
    assert tokenizer("</s>", add_special_tokens=False).input_ids != [2]  # literal text, as fairseq reads it
    ids = tokenizer("The grammar, naïve 🙂").input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The grammar, naïve 🙂"
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id) == (2, 1, 3)
    assert tokenizer.convert_ids_to_tokens(len(dictionary) - 1).startswith("madeupword")


def test_tokenizer_refuses_a_dictionary_without_every_token(gpt2_run, tmp_path):
    from fairseq.export.hf_tokenizer import gpt2_tokenizer

    partial = Dictionary()
    for i in range(300):  # the 256 bytes and a few merges only
        partial.add_symbol(str(i))
    with pytest.raises(ValueError, match=r"lacks \d+ of the \d+ tokens GPT-2 BPE can output.*--no-tokenizer"):
        gpt2_tokenizer(str(gpt2_run["enc"]), str(gpt2_run["vocab"]), partial)
    # The same through the export: nothing is written.
    ckpt = write_checkpoint(tmp_path / "ck", partial, arch="transformer_lm_gpt3_small")
    bpe = {"_name": "gpt2", "gpt2_encoder_json": str(gpt2_run["enc"]), "gpt2_vocab_bpe": str(gpt2_run["vocab"])}
    with pytest.raises(ValueError, match="lacks"):
        hf.export(ckpt, str(tmp_path / "out"), bpe=bpe)
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == ["ck"]
    hf.export(ckpt, str(tmp_path / "out"), bpe=bpe, tokenizer=False)
    assert not (tmp_path / "out" / "tokenizer.json").exists()


# ----------------------------------------------------------------------------- the other kinds


KINDS = {
    # name: (arch, options, expected architecture)
    "xglm_sinusoidal_prenorm": ("transformer_lm_gpt", {}, "XGLMForCausalLM"),
    "xglm_tied_unscaled_relu": (
        "transformer_lm_gpt",
        {"share_decoder_input_output_embed": True, "no_scale_embedding": True, "activation_fn": "relu"},
        "XGLMForCausalLM",
    ),
    "opt_sinusoidal_postnorm": (
        "transformer_lm",
        {"decoder_input_dim": 32, "decoder_output_dim": 32, "share_decoder_input_output_embed": True},
        "OPTForCausalLM",
    ),
    "opt_projections_no_final_norm": (
        "transformer_lm",
        {
            "decoder_learned_pos": True,
            "decoder_normalize_before": True,
            "no_decoder_final_norm": True,
            "no_scale_embedding": True,
            "activation_fn": "gelu_accurate",
            "decoder_input_dim": 16,
            "decoder_output_dim": 16,
            "share_decoder_input_output_embed": True,
        },
        "OPTForCausalLM",
    ),
    "opt_no_positions": (
        "transformer_lm_gpt3_small",
        {"no_token_positional_embeddings": True, "activation_fn": "tanh"},
        "OPTForCausalLM",
    ),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_exported_kind_computes_the_same(kind, tmp_path):
    arch, options, expected = KINDS[kind]
    dictionary = word_dictionary()
    ckpt = write_checkpoint(tmp_path / "ck", dictionary, arch=arch, **options)
    result = hf.export(ckpt, str(tmp_path / "hf"))
    assert result["architecture"] == expected and result["tokenizer"] is None
    fork = fork_model(ckpt, dictionary)
    model = load_hf(tmp_path / "hf")
    assert type(model).__name__ == expected
    rows = random_rows(len(dictionary), [24, 17, 9, 1])
    assert_same_logits(fork, model, rows)
    assert_same_greedy(fork, model, [r[:n] for r, n in zip(rows, (7, 4, 1))])  # left padding: 0, 3 and 6


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP read in one process, as intended
def test_sharded_checkpoint_and_weight_shards(tiny_data, build_train_args, tmp_path):
    """fairseq-train --use-sharded-state (the conftest's tiny transformer_lm_gpt: sinusoidal, pre-norm, untied)
    writes a DCP directory; the export reads it (dict.txt from the checkpoint's data directory) as XGLM and
    splits the weights into several safetensors files with an index."""
    import torch.distributed as dist

    from fairseq_cli import train

    was_initialized = dist.is_initialized()
    try:
        train.cli_main(
            build_train_args(
                tiny_data,
                tmp_path / "ck",
                "--disable-validation",
                "--ddp-backend",
                "fully_sharded",
                "--use-sharded-state",
                max_update=2,
                arch="transformer_lm_gpt",
                json_log=False,
                log_file=False,
            )
        )
    finally:
        if dist.is_initialized() and not was_initialized:  # the one-process group FSDP made: leave none behind
            dist.destroy_process_group()
    checkpoint = tmp_path / "ck" / "checkpoint_last"
    assert checkpoint.is_dir()
    result = hf.export(str(checkpoint), str(tmp_path / "hf"), max_shard_size="20KB")
    assert result["architecture"] == "XGLMForCausalLM"
    assert len(result["weights"]) > 2 and result["weights"][-1] == "model.safetensors.index.json"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(result["weights"][:-1])
    dictionary = Dictionary.load(str(tiny_data / "dict.txt"))
    fork = fork_model(checkpoint, dictionary)
    model = load_hf(tmp_path / "hf")
    assert_same_logits(fork, model, random_rows(len(dictionary), [32, 11, 3]))


def test_dtype_and_bos_token(tmp_path):
    """--dtype casts the weights; a model trained with --add-bos-token starts from <s> (id 0) everywhere."""
    dictionary = word_dictionary()
    ckpt = write_checkpoint(tmp_path / "ck", dictionary, arch="transformer_lm_gpt3_small", add_bos_token=True)
    hf.export(ckpt, str(tmp_path / "hf"), dtype="bfloat16")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["bos_token_id"] == 0 and generation["bos_token_id"] == 0


# ----------------------------------------------------------------------------- sentencepiece


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory):
    """{"bpe": the shared sentencepiece BPE model, "unigram": one of sentencepiece's default kind}."""
    spm = pytest.importorskip("sentencepiece")
    root = tmp_path_factory.mktemp("export_spm")
    bpe_model = train_spm_model(root)
    spm.SentencePieceTrainer.Train(
        f"--input={root / 'spm_train.txt'} --model_prefix={root / 'unigram'} "
        "--vocab_size=300 --model_type=unigram --minloglevel=2"
    )
    return {"bpe": str(bpe_model), "unigram": str(root / "unigram.model")}


def test_sentencepiece_tokenizer_gives_fairseq_ids(spm_models, tmp_path):
    """A dict.txt made from the model's pieces (upstream's recipe: spm.vocab without its first three lines),
    shuffled; a model with --add-bos-token, so encoding starts with <s>."""
    import sentencepiece as spm

    from fairseq.data.encoders.sentencepiece_bpe import SentencepieceBPE, SentencepieceConfig

    model_file = spm_models["bpe"]
    sp = spm.SentencePieceProcessor(model_file=model_file)
    pieces = [sp.IdToPiece(i) for i in range(3, sp.GetPieceSize())]
    random.Random(1).shuffle(pieces)
    dictionary = Dictionary()
    for p in pieces:
        dictionary.add_symbol(p, 100)
    dictionary.pad_to_multiple_(8)
    ckpt = write_checkpoint(tmp_path / "ck", dictionary, arch="transformer_lm_gpt3_small", add_bos_token=True)
    bpe_cfg = {"_name": "sentencepiece", "sentencepiece_model": model_file}
    result = hf.export(ckpt, str(tmp_path / "hf"), bpe=bpe_cfg)
    assert result["tokenizer"] == "sentencepiece"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    bpe = SentencepieceBPE(SentencepieceConfig(sentencepiece_model=model_file))
    for text in sample_text().split("\n")[:2000] + TRICKY.split("\n") + EXTRA_TEXT:
        assert tokenizer(text, add_special_tokens=False).input_ids == fairseq_ids(bpe, dictionary, text), repr(text)
    ids = tokenizer("The grammar").input_ids
    assert ids[0] == 0 and tokenizer.decode(ids, skip_special_tokens=True) == "The grammar"
    fork = fork_model(ckpt, dictionary)
    assert_same_logits(fork, load_hf(tmp_path / "hf"), [ids, ids[:2]])


def test_sentencepiece_refusals(spm_models, tmp_path):
    from fairseq.export.hf_tokenizer import bpe_tokenizer

    d = Dictionary()
    with pytest.raises(ValueError, match="a unigram model .*--no-tokenizer"):
        bpe_tokenizer({"_name": "sentencepiece", "sentencepiece_model": spm_models["unigram"]}, d, 2)
    with pytest.raises(ValueError, match="lacks 2\\d\\d of the 2\\d\\d tokens the sentencepiece model can output"):
        bpe_tokenizer({"_name": "sentencepiece", "sentencepiece_model": spm_models["bpe"]}, d, 2)
    (tmp_path / "x.model").write_bytes(b"\xff\xff\xff")
    with pytest.raises(ValueError, match="is not a sentencepiece model file"):
        bpe_tokenizer({"_name": "sentencepiece", "sentencepiece_model": str(tmp_path / "x.model")}, d, 2)


# ----------------------------------------------------------------------------- refusals and the CLI


REFUSED = {
    # name: (arch, options, export keyword arguments, message)
    "layernorm_embedding": ("transformer_lm_gpt3_small", {"layernorm_embedding": True}, {}, "--layernorm-embedding"),
    "xglm_for_learned": ("transformer_lm_gpt3_small", {}, {"model_type": "xglm"}, "--decoder-learned-pos"),
    "xglm_for_postnorm": ("transformer_lm", {}, {"model_type": "xglm"}, r"post-norm \(--decoder-normalize-before"),
    "xglm_no_final_norm": (
        "transformer_lm_gpt",
        {"no_decoder_final_norm": True},
        {"model_type": "xglm"},
        "--no-decoder-final-norm",
    ),
    "input_output_dims": (
        "transformer_lm",
        {"decoder_input_dim": 16, "decoder_output_dim": 24},
        {},
        "--decoder-input-dim 16 differs from --decoder-output-dim 24",
    ),
    "output_dictionary_size": ("transformer_lm_gpt", {"output_dictionary_size": 40}, {}, "--output-dictionary-size"),
    "bad_dtype": ("transformer_lm_gpt", {}, {"dtype": "int8"}, "--dtype 'int8'"),
    "bad_shard_size": ("transformer_lm_gpt", {}, {"max_shard_size": "lots"}, "--max-shard-size 'lots'"),
    "saved_bpe_missing": (
        "transformer_lm_gpt",
        {},
        {"bpe": {"_name": "gpt2", "gpt2_encoder_json": "/nope.json", "gpt2_vocab_bpe": "/nope.bpe"}},
        "--gpt2-encoder-json /nope.json: no such file",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refusals_name_the_option(name, tmp_path):
    arch, options, kwargs, message = REFUSED[name]
    ckpt = write_checkpoint(tmp_path / "ck", word_dictionary(), arch=arch, **options)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        hf.export(ckpt, str(tmp_path / "out"), **kwargs)
    assert not (tmp_path / "out").exists()


EXPORT_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "export_hf.py")


def export_script():
    """scripts/export_hf.py as a module, for its main in this process."""
    spec = importlib.util.spec_from_file_location("export_hf_script", EXPORT_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_cli_writes_and_refuses_in_one_line(tmp_path, capsys, gpt2_run):
    script = export_script()

    dictionary = word_dictionary()
    ok = write_checkpoint(tmp_path / "ok", dictionary, arch="transformer_lm_gpt")
    run_console_script("export_hf", script.main, [ok, str(tmp_path / "hf")])
    assert "wrote" in capsys.readouterr().out and (tmp_path / "hf" / "model.safetensors").is_file()
    cases = [
        ([ok, str(tmp_path / "hf")], "holds an earlier output of scripts/export_hf.py; pass --overwrite"),
        (
            [
                write_checkpoint(tmp_path / "ln", dictionary, arch="transformer_lm_gpt", layernorm_embedding=True),
                str(tmp_path / "x"),
            ],
            "--layernorm-embedding",
        ),
        ([str(tmp_path / "missing.pt"), str(tmp_path / "x")], "checkpoint not found"),
        ([ok, str(tmp_path / "x"), "--dict", str(tmp_path / "nodict.txt")], "--dict"),
        (
            [
                ok,
                str(tmp_path / "x"),
                "--bpe",
                "gpt2",
                "--gpt2-encoder-json",
                str(gpt2_run["enc"]),
                "--gpt2-vocab-bpe",
                str(gpt2_run["vocab"]),
            ],
            "lacks",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            run_console_script("export_hf", script.main, argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 1 and len(err) == 1 and err[0].startswith("export_hf: error: "), err
        assert message in err[0], err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "xglm"
    # Sinusoidal pre-norm fits XGLM (auto's choice) and OPT (the table written out), on request.
    run_console_script("export_hf", script.main, [ok, str(tmp_path / "hf"), "--overwrite", "--model-type", "opt"])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "opt"


def test_unwritable_output_is_one_line_and_keeps_an_earlier_export(tmp_path, capsys):
    """OUTPUT under a file (ENOTDIR/EEXIST, in this process) and a file-size limit (EFBIG, in a subprocess: the
    limit is the process's) are one line naming OUTPUT and the errno; an export already at OUTPUT is left as it
    was."""
    ok = write_checkpoint(tmp_path / "ok", word_dictionary(), arch="transformer_lm_gpt")
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    out = tmp_path / "hf"
    hf.export(ok, str(out))
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # below model.safetensors' size

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_console_script("export_hf", export_script().main, [ok, str(blocker / "hf"), "--overwrite"])
    in_process = capsys.readouterr().err
    r = subprocess.run(
        [sys.executable, EXPORT_SCRIPT, ok, str(out), "--overwrite"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
    )
    for status, stderr, output, code in (
        (exit_info.value.code, in_process, blocker / "hf", "EEXIST"),
        (r.returncode, r.stderr, out, "EFBIG"),
    ):
        err = stderr.strip().splitlines()
        assert status == 1 and "Traceback" not in stderr, stderr[-2000:]
        assert err[-1].startswith(f"export_hf: error: cannot write the export {output}: ") and f"({code})" in err[-1]
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["a_file", "hf", "ok"]
