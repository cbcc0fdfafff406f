"""A transformers OPT or XGLM model directory -> a checkpoint of this fork: the export (hf.py) the other way,
through the same name tables (hf_names). `scripts/import_hf.py HF_DIR OUT_DIR` and `from_pretrained` on such a
directory (fairseq.hub.pretrained) come here; docs/export_hf.md ("The way back") says what maps.

OUT_DIR gets `checkpoint_best.pt` (cfg: --arch transformer_lm with its options set, --task language_modeling,
the --bpe; the weights; the `vocabulary` record of fairseq.checkpoint.vocabulary; it loads with
torch.load(weights_only=True), as fairseq-eval-lm, the hub and --finetune-from-model read it), `dict.txt` and
the --bpe files (hf_import_vocab: every id unchanged), and `model_flags.txt`, the fairseq-train flags that build
the same model (for --finetune-from-model, which checks only shapes).

- OPTForCausalLM: learned positions (OPT's offset 2 is fairseq's padding_idx + 1: the table as it is), pre- or
  post-norm (do_layer_norm_before), the final layer norm unless _remove_final_layer_norm, the bias-free
  project_in/project_out (word_embed_proj_dim: --decoder-input-dim = --decoder-output-dim), no embedding scale
  (--no-scale-embedding), tied or not. enable_bias = false and layer_norm_elementwise_affine = false have no
  option here: the biases are written as zeros and the norms' scales as ones, which computes the same function
  (fine-tuning then trains them).
- XGLMForCausalLM: sinusoidal positions (fairseq's table: padding row 1, offset 2), pre-norm with the final layer
  norm, scale_embedding, tied or not.

A directory the export wrote (it has dict.txt) comes back as the checkpoint it was made from: an OPT input matrix
equal to the output matrix times sqrt(embed dim) (the export folds fairseq's scale in) is the shared, scaled
one; an OPT position table equal to fairseq's sinusoidal table (or all zeros) is sinusoidal (or no) positions.
"""

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from fairseq.checkpoint.io import torch_save_raising_os_errors
from fairseq.checkpoint.vocabulary import KEY as VOCABULARY_KEY, make_record
from fairseq.dataclass.utils import config_to_dict, flag_name
from fairseq.export import require_transformers
from fairseq.export.hf_import_vocab import Vocabulary, read_vocabulary
from fairseq.export.hf_names import (
    CONFIG_FIELDS,
    EMBED,
    FORK_ACTIVATIONS,
    FORK_TOKENIZER_FILES,
    HF_ARCHITECTURES,
    OUTPUT,
    PAD,
    POSITIONS,
    weight_names,
)
from fairseq.export.output_dir import assembled, check_output
from fairseq.export.safetensors_shards import read_weights
from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config
from fairseq.modules.positional_embedding import sinusoidal_table

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint_best.pt"
FLAGS_NAME = "model_flags.txt"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The options model_flags writes (the others are transformer_lm's defaults, which the import keeps).
_FLAG_OPTIONS = (
    "decoder_layers",
    "decoder_embed_dim",
    "decoder_input_dim",
    "decoder_output_dim",
    "decoder_ffn_embed_dim",
    "decoder_attention_heads",
    "decoder_normalize_before",
    "no_decoder_final_norm",
    "no_token_positional_embeddings",
    "decoder_learned_pos",
    "no_scale_embedding",
    "share_decoder_input_output_embed",
    "activation_fn",
    "dropout",
    "attention_dropout",
    "activation_dropout",
)


@dataclass
class HFModel:
    """A transformers directory read: its model type, config object (transformers' defaults filled in) and
    weights (transformers' names, stored dtypes)."""

    directory: str
    model_type: str
    hf: Any  # OPTConfig / XGLMConfig
    weights: Dict[str, torch.Tensor]
    files: List[str]

    @property
    def where(self) -> str:
        return os.path.join(self.directory, self.files[0] if len(self.files) == 1 else "(weight files)")


def read_hf(hf_dir: str) -> HFModel:
    """config.json (an OPT or XGLM one, else a one-line error naming its model_type) and the weights."""
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(
            f"{hf_dir}: no such directory; pass a transformers model directory (config.json and "
            "the weights save_pretrained wrote)"
        )
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path}: no such file; pass a transformers model directory (config.json and the "
            "weights save_pretrained wrote)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); copy the file again") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in HF_ARCHITECTURES:
        names = ", ".join((raw.get("architectures") or []) if isinstance(raw, dict) else []) or "no architectures"
        raise ValueError(
            f"{path}: model_type {model_type!r} ({names}) is not OPT or XGLM; the import maps "
            "OPTForCausalLM and XGLMForCausalLM (the models fairseq and metaseq trained) only; convert "
            "other architectures with their own project's tools"
        )
    check_config_types(raw, path)
    require_transformers("importing from transformers")
    import transformers  # deferred: optional (the export extra)

    hf = (transformers.OPTConfig if model_type == "opt" else transformers.XGLMConfig).from_dict(raw)
    weights, files = read_weights(hf_dir)
    return HFModel(hf_dir, model_type, hf, _with_model_prefix(weights), files)


# The config.json keys the import reads, by what their values must be (absent: transformers' default).
_COUNTS = ("num_hidden_layers", "num_layers")  # 0 layers is a model (embeddings and output only)
_SIZES = (
    "hidden_size",
    "d_model",
    "ffn_dim",
    "num_attention_heads",
    "attention_heads",
    "max_position_embeddings",
    "vocab_size",
)
_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
_SWITCHES = (
    "do_layer_norm_before",
    "_remove_final_layer_norm",
    "enable_bias",
    "layer_norm_elementwise_affine",
    "tie_word_embeddings",
    "scale_embedding",
)
_PROBABILITIES = ("dropout", "attention_dropout", "activation_dropout")


def _expected(key: str, value) -> Optional[str]:
    """What `value` of `key` should be, when it is not that; None when it is (or the key is not read)."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if key in _COUNTS:
        return None if is_int and value >= 0 else "an integer >= 0"
    if key in _SIZES or key == "word_embed_proj_dim":
        ok = (is_int and value > 0) or (value is None and key == "word_embed_proj_dim")
        return None if ok else "a positive integer" + (" or null" if key == "word_embed_proj_dim" else "")
    if key in _IDS:
        return None if is_int and value >= 0 else "an integer >= 0"
    if key in _SWITCHES:
        return None if isinstance(value, bool) else "true or false"
    if key in _PROBABILITIES:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if number and 0 <= value < 1 else "a number from 0 to below 1"
    if key == "activation_function":
        return None if isinstance(value, str) else "a string"
    return None


def check_config_types(raw: Dict[str, Any], path: str) -> None:
    """One line naming the key, its value and what it should be, for the first value of config.json the import
    reads that is not of its kind (before transformers' own checks, whose traceback names no file)."""
    for key, value in raw.items():
        expected = _expected(key, value)
        if expected is not None:
            kind = {
                bool: "a boolean",
                int: "an integer",
                float: "a number",
                str: "a string",
                list: "a list",
                dict: "an object",
            }.get(type(value))
            raise ValueError(f"{path}: {key} is {json.dumps(value)}{f' ({kind})' if kind else ''}; expected {expected}")


def _with_model_prefix(weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    # OPT's and XGLM's released pytorch_model.bin files hold the base model's names (no "model." prefix).
    if any(k.startswith("model.") for k in weights):
        return weights
    return {(k if k == "lm_head.weight" else "model." + k): v for k, v in weights.items()}


# ------------------------------------------------------------------------------------------------ the config


def fork_values(model: HFModel) -> Dict[str, Any]:
    """The fork's transformer_lm options computing what the transformers config describes."""
    hf, path = model.hf, os.path.join(model.directory, "config.json")
    values = {name: getattr(hf, hf_name) for name, hf_name in CONFIG_FIELDS[model.model_type]}
    if hf.activation_function not in FORK_ACTIVATIONS:
        raise ValueError(
            f"{path}: activation_function {hf.activation_function!r} has no --activation-fn here "
            f"(known: {', '.join(sorted(FORK_ACTIVATIONS))})"
        )
    dim = values["decoder_embed_dim"]
    if model.model_type == "opt":
        proj = values["decoder_input_dim"] or dim
        values.update(
            decoder_input_dim=proj,
            decoder_output_dim=proj,
            decoder_learned_pos=True,
            no_scale_embedding=True,
            activation_dropout=0.0,
            no_decoder_final_norm=bool(hf.do_layer_norm_before and hf._remove_final_layer_norm),
        )
        begin = hf.bos_token_id
    else:
        values.update(
            decoder_input_dim=dim,
            decoder_output_dim=dim,
            decoder_normalize_before=True,
            decoder_learned_pos=False,
            no_decoder_final_norm=False,
            no_scale_embedding=not hf.scale_embedding,
            activation_dropout=hf.activation_dropout,
        )
        begin = hf.decoder_start_token_id
    if begin not in (0, 2):
        raise ValueError(
            f"{path}: sequences start with id {begin}; fairseq's start with </s> (2), or <s> (0) with --add-bos-token"
        )
    values.update(
        activation_fn=FORK_ACTIVATIONS[hf.activation_function],
        layernorm_embedding=False,
        share_decoder_input_output_embed=bool(hf.tie_word_embeddings),
        tokens_per_sample=values["max_target_positions"],
        add_bos_token=begin == 0,
    )
    return values


def model_flags(cfg) -> List[str]:
    """fairseq-train's flags that build `cfg` (a TransformerLanguageModelConfig): --arch transformer_lm, every
    number and name of _FLAG_OPTIONS (some defaults follow others: all are spelled out), the switches that are
    on, then --max-target-positions and --tokens-per-sample of the model's positions (fairseq-train's default
    blocks of 1024 do not fit a model of fewer)."""
    flags = ["--arch", "transformer_lm"]
    for name in _FLAG_OPTIONS:
        value = getattr(cfg, name)
        if not isinstance(value, bool):
            flags += [flag_name(name), str(value)]
        elif value:
            flags.append(flag_name(name))
    positions = str(cfg.max_target_positions)
    return flags + ["--max-target-positions", positions, "--tokens-per-sample", positions]


# ------------------------------------------------------------------------------------------------ the weights


def fork_state(model: HFModel, values: Dict[str, Any], from_export: bool) -> Dict[str, torch.Tensor]:
    """The fork's state dict (its keys, in order) from the transformers weights; `values` may change where a
    directory the export wrote is read back (`from_export`)."""
    hf, weights, opt = model.hf, dict(model.weights), model.model_type == "opt"
    layers, tied = values["decoder_layers"], values["share_decoder_input_output_embed"]
    final_norm = values["decoder_normalize_before"] and not values["no_decoder_final_norm"]
    projections = values["decoder_input_dim"] != values["decoder_embed_dim"]
    pairs = weight_names(
        model.model_type,
        layers,
        positions=opt,
        project_in=projections,
        project_out=projections,
        final_norm=final_norm,
        head=not tied,
    )
    if opt:
        _materialize_optional(weights, pairs, hf, model)
    state = {}
    for key, hf_name in pairs:
        if hf_name not in weights:
            raise ValueError(
                f"{model.where} has no tensor {hf_name}, which {HF_ARCHITECTURES[model.model_type]} "
                "with this config.json has: the weights are not this config's model"
            )
        state[key] = weights.pop(hf_name)
    weights.pop("model.embed_positions.weights", None)  # XGLM's sinusoidal buffer, in older files
    if tied:
        weights.pop("lm_head.weight", None)  # transformers ties it to the input embeddings
    if weights:
        raise ValueError(
            f"{model.where}: {len(weights)} tensor(s) the import does not map (e.g. {sorted(weights)[0]}):"
            f" not an {HF_ARCHITECTURES[model.model_type]} as transformers builds it from config.json"
        )
    if opt and from_export:
        _fork_layout_of_export(state, values)
    return state


def _materialize_optional(weights, pairs, hf, model: HFModel) -> None:
    """OPT without biases or without the norms' scale and shift: zeros and ones, the same function."""
    norms = ("layer_norm.weight", "layer_norm.bias")
    missing = [
        hf_name
        for _, hf_name in pairs
        if hf_name not in weights
        and (
            (not hf.enable_bias and hf_name.endswith(".bias") and not hf_name.endswith(norms))
            or (not hf.layer_norm_elementwise_affine and hf_name.endswith(norms))
        )
    ]
    for hf_name in missing:
        module = hf_name.rsplit(".", 1)[0]
        like = weights.get(module + ".weight")
        if like is None:  # an affine-free norm: its size is the model's width
            size, dtype = model.hf.hidden_size, next(iter(weights.values())).dtype
        else:
            size, dtype = like.size(0), like.dtype
        fill = 1.0 if hf_name.endswith("layer_norm.weight") else 0.0
        weights[hf_name] = torch.full((size,), fill, dtype=dtype)
    if missing:
        logger.warning(
            f"{model.directory}: enable_bias={hf.enable_bias}, layer_norm_elementwise_affine="
            f"{hf.layer_norm_elementwise_affine}: {len(missing)} bias / norm tensors written as zeros and "
            "ones (the same function; fine-tuning trains them, and the export writes them back)"
        )


def _fork_layout_of_export(state: Dict[str, torch.Tensor], values: Dict[str, Any]) -> None:
    """Undo what the export does to fit OPT (see the module's docstring), where the tensors say it was done."""
    scale = math.sqrt(values["decoder_embed_dim"])
    out = state.get(OUTPUT)
    if (
        out is not None
        and out.shape == state[EMBED].shape
        and torch.equal(state[EMBED], (out.float() * scale).to(out.dtype))
    ):
        state[EMBED] = state.pop(OUTPUT)
        values.update(share_decoder_input_output_embed=True, no_scale_embedding=False)
    table = state[POSITIONS]
    if torch.equal(table, sinusoidal_table(table.size(0), table.size(1), PAD).to(table.dtype)):
        del state[POSITIONS]
        values.update(decoder_learned_pos=False)
    elif not table.any():
        del state[POSITIONS]
        values.update(no_token_positional_embeddings=True)


def complete_state(state: Dict[str, torch.Tensor], cfg, rows: int) -> Dict[str, torch.Tensor]:
    """`state` with the model's buffers (version, the sinusoidal placeholder) and the shared output matrix, in
    the model's key order; its shapes checked against the model `cfg` builds."""
    with torch.device("meta"):
        expected = TransformerLanguageModel.build(cfg, rows, PAD).state_dict()
    out = {}
    for key, meta in expected.items():
        if key in state:
            out[key] = state[key]
        elif key == OUTPUT:
            out[key] = state[EMBED]  # shared: the same tensor, saved once
        elif key == "decoder.version":
            out[key] = torch.tensor([3.0])
        elif key.endswith("._float_tensor"):
            out[key] = torch.zeros(1)
        else:
            raise RuntimeError(f"import: no value for {key}")
        if tuple(out[key].shape) != tuple(meta.shape):
            raise ValueError(
                f"import: {key} is {tuple(out[key].shape)} but the model config.json describes has "
                f"{tuple(meta.shape)} there; the weights do not fit config.json"
            )
    extra = sorted(set(state) - set(out))
    if extra:
        raise RuntimeError(f"import: {extra[0]} has no place in the model")
    return out


# ------------------------------------------------------------------------------------------------ the import


def import_hf(hf_dir: str, out_dir: str, dtype: Optional[str] = None, overwrite: bool = False) -> Dict[str, Any]:
    """Write OUT_DIR (see the module's docstring) for the transformers directory `hf_dir`; returns what was
    written. `dtype` (float32, float16, bfloat16) casts the weights, else they keep the stored dtype."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    check_output(out_dir, overwrite, "import_hf", [hf_dir])
    model = read_hf(hf_dir)
    values = fork_values(model)
    embed = model.weights.get(("model.decoder." if model.model_type == "opt" else "model.") + "embed_tokens.weight")
    rows = embed.size(0) if embed is not None else model.hf.vocab_size
    if rows != model.hf.vocab_size:
        raise ValueError(
            f"{model.where}: the token embedding has {rows:,} rows but config.json says vocab_size "
            f"{model.hf.vocab_size:,}; the weights are not this config's model"
        )
    vocab = read_vocabulary(hf_dir, model.model_type, rows, model.hf.pad_token_id, model.hf.eos_token_id)
    state = fork_state(model, values, from_export=os.path.isfile(os.path.join(hf_dir, "dict.txt")))
    if dtype is not None:
        state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}
    add_bos = values.pop("add_bos_token")
    cfg = preset_config("transformer_lm", **values)
    state = complete_state(state, cfg, rows)
    with assembled(out_dir, "cannot write the import", "import_hf", "OUT_DIR") as tmp:
        _write(tmp, out_dir, cfg, state, vocab, add_bos)
    architecture = HF_ARCHITECTURES[model.model_type]
    logger.info(
        f"wrote {out_dir}: {architecture} as transformer_lm ({cfg.decoder_layers} layers, {rows:,} rows; "
        f"tokenizer from {vocab.source})"
    )
    bpe_flags = (
        []
        if vocab.bpe is None
        else ["--bpe", vocab.bpe]
        + [
            f
            for name, option in FORK_TOKENIZER_FILES.items()
            if name in vocab.files
            for f in (flag_name(option), os.path.join(out_dir, name))
        ]
    )
    return {
        "checkpoint": os.path.join(out_dir, CHECKPOINT_NAME),
        "architecture": architecture,
        "bpe": vocab.bpe,
        "flags": model_flags(cfg) + (["--add-bos-token"] if add_bos else []),
        "bpe_flags": bpe_flags,
        "positions": cfg.max_target_positions,
    }


def _write(tmp: str, out_dir: str, cfg, state, vocab: Vocabulary, add_bos: bool) -> None:
    vocab.dictionary.save(os.path.join(tmp, "dict.txt"))
    for name, content in vocab.files.items():
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(content)
    bpe = None
    if vocab.bpe is not None:
        bpe = {
            "_name": vocab.bpe,
            **{option: os.path.join(tmp, name) for name, option in FORK_TOKENIZER_FILES.items() if name in vocab.files},
        }
    record = make_record(vocab.dictionary, bpe)
    final = os.path.abspath(out_dir)
    for option in list(bpe or ()):  # the paths the files will have once the directory is in place
        if option != "_name":
            bpe[option] = os.path.join(final, os.path.basename(bpe[option]))
            record["bpe"]["files"][option]["path"] = bpe[option]
    task = {
        "_name": "language_modeling",
        "data": final,
        "tokens_per_sample": cfg.max_target_positions,
        "max_target_positions": cfg.max_target_positions,
        "add_bos_token": add_bos,
    }
    torch_save_raising_os_errors(
        {"cfg": {"model": config_to_dict(cfg), "task": task, "bpe": bpe}, "model": state, VOCABULARY_KEY: record},
        os.path.join(tmp, CHECKPOINT_NAME),
    )
    with open(os.path.join(tmp, FLAGS_NAME), "w", encoding="utf-8") as f:
        f.write(" ".join(model_flags(cfg) + (["--add-bos-token"] if add_bos else [])) + "\n")
