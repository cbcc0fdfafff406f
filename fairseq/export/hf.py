"""A checkpoint of this fork -> a Hugging Face `transformers` model directory (`scripts/export_hf.py`).

What is written (see docs/export_hf.md): `config.json`, `generation_config.json`, `model.safetensors` (or
shards and their index), `dict.txt` (the fairseq dictionary, for the way back) and, when a GPT-2 BPE or a
sentencepiece model is given or saved in the checkpoint, the tokenizer files (`fairseq.export.hf_tokenizer`) and
the --bpe files themselves (`encoder.json` + `vocab.bpe`, or `sentencepiece.bpe.model`: for the way back).

Only exact equivalents are written: the exported model computes the same function as `TransformerLanguageModel`
at every real token (the vocabulary is the fairseq dictionary, ids unchanged). Two targets:

- `OPTForCausalLM` ("opt"): learned positions are OPT's table as they are (fairseq counts positions from
  padding_idx + 1 = 2 over non-pad tokens, OPT from 2 over attention-mask ones: the same rows). Sinusoidal
  positions are written as OPT's table too (the rows fairseq computes, for the model's max positions), and
  no positions as a zero table. Pre- or post-norm (`do_layer_norm_before`), with or without the final layer
  norm (`_remove_final_layer_norm`), the bias-free input/output projections (`word_embed_proj_dim`). OPT does not
  scale its embeddings: the sqrt(embed dim) scale is folded into the input embedding matrix, so a tied model
  is written untied (the output matrix stays the unscaled one).
- `XGLMForCausalLM` ("xglm"): sinusoidal positions (the same table: sin then cos halves, frequencies
  exp(-i ln(10000) / (half - 1)), row padding_idx zero, offset 2), `scale_embedding`, pre-norm with a final
  layer norm, no projections.

Anything else (e.g. --layernorm-embedding) is refused with a ValueError naming the option.
"""

import logging
import math
import os
import shutil
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from fairseq import registry
from fairseq.checkpoint.fit import check_architecture
from fairseq.checkpoint.inference import ShardedCheckpoint, read_checkpoint_config
from fairseq.checkpoint.vocabulary import carried, check_dictionary
from fairseq.data.dictionary import Dictionary
from fairseq.dataclass.utils import config_from_dict
from fairseq.export import require_transformers
from fairseq.export.hf_names import (
    ACTIVATIONS,
    CONFIG_FIELDS,
    EMBED,
    FORK_TOKENIZER_FILES,
    HF_ARCHITECTURES,
    PAD,
    POSITIONS,
    PROJECT_IN,
    PROJECT_OUT,
    weight_names,
)
from fairseq.export.hf_tokenizer import build_hf_tokenizer, export_bpe
from fairseq.export.output_dir import assembled, check_output
from fairseq.export.safetensors_shards import TensorSpec, parse_size, write_shards
from fairseq.models.transformer_lm import TransformerLanguageModel, resolve_max_target_positions
from fairseq.modules.positional_embedding import sinusoidal_table

logger = logging.getLogger(__name__)

MODEL_TYPES = ("auto", "opt", "xglm")
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


# ------------------------------------------------------------------------------------------------ the source


@dataclass
class Source:
    """A loaded checkpoint: its resolved model config, model state dict, dictionary and saved config."""

    path: str
    cfg: object  # TransformerLanguageModelConfig
    state: Dict[str, torch.Tensor]
    dictionary: Dictionary
    dict_path: str
    saved_cfg: dict
    vocabulary: Optional[dict] = None  # what the checkpoint carries (fairseq.checkpoint.vocabulary)

    @property
    def tied(self) -> bool:
        return bool(self.cfg.share_decoder_input_output_embed)

    @property
    def learned_positions(self) -> bool:
        return "decoder.embed_positions.weight" in self.state

    @property
    def has_positions(self) -> bool:
        return not self.cfg.no_token_positional_embeddings

    @property
    def begin_token(self) -> int:
        """The first input of every sequence the model was trained on: <s> with --add-bos-token, else </s>
        (fairseq's token blocks and its generator start from </s>)."""
        add_bos = (self.saved_cfg.get("task") or {}).get("add_bos_token") or self.cfg.add_bos_token
        return self.dictionary.bos() if add_bos else self.dictionary.eos()


def find_dictionary(path: str, saved_cfg: dict, dict_path: Optional[str]) -> str:
    """--dict, else dict.txt beside the checkpoint (or inside a sharded directory), else in its --task data dir."""
    if dict_path:
        if not os.path.isfile(dict_path):
            raise FileNotFoundError(f"--dict {dict_path} does not exist; pass the dict.txt the model was trained with")
        return dict_path
    here = os.path.abspath(path)
    candidates = [os.path.join(here, "dict.txt")] if os.path.isdir(here) else []
    candidates.append(os.path.join(os.path.dirname(here), "dict.txt"))
    data = (saved_cfg.get("task") or {}).get("data")
    if data:
        candidates.append(os.path.join(str(data).split(os.pathsep)[0], "dict.txt"))
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"no dict.txt found for {path} (looked in: {', '.join(candidates)}); pass --dict "
        "PATH/dict.txt, the dictionary of the data the model was trained on"
    )


def load_source(path: str, dict_path: Optional[str] = None, trust_legacy: bool = False) -> Source:
    """Read a checkpoint file or a sharded checkpoint directory with the project's safe loaders (one copy of the
    model weights; a single file's optimizer state is released once read)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    saved_cfg, state = read_checkpoint_config(path, trust_legacy=trust_legacy)
    model_values = dict(saved_cfg.get("model") or {})
    arch = model_values.get("_name") or model_values.get("arch")
    if not arch or registry.arch_model(arch) is not TransformerLanguageModel:
        raise ValueError(
            f"{path}: --arch {arch} is not a transformer_lm architecture; only transformer_lm "
            "language models can be exported to transformers"
        )
    cfg = config_from_dict(registry.dataclass_of(TransformerLanguageModel), model_values, name=arch)
    cfg.max_target_positions = resolve_max_target_positions(cfg)
    vocabulary = carried(state)
    if isinstance(state, ShardedCheckpoint):
        # torch.distributed.checkpoint costs seconds, which the hub's importers (fairseq-serve) would pay
        from fairseq.checkpoint.consolidate import read_full_state  # deferred: startup

        model_state = read_full_state(state.path, keys=["model"], trust_legacy=state.trust_legacy)["model"]
    else:
        model_state = state.pop("model")
    del state  # a single file's optimizer state and the rest go now
    model_state = {k: v for k, v in model_state.items() if torch.is_tensor(v)}

    dict_path = find_dictionary(path, saved_cfg, dict_path)
    dictionary = Dictionary.load(dict_path)
    output_size = (saved_cfg.get("task") or {}).get("output_dictionary_size", -1)  # --output-dictionary-size
    with torch.device("meta"):  # the shapes the config and dictionary imply, without allocating them
        expected = TransformerLanguageModel.build(
            cfg,
            len(dictionary),
            dictionary.pad(),
            output_vocab_size=(output_size if output_size is not None and output_size >= 0 else None),
        ).state_dict()
    check_architecture(path, {"model": model_state, "cfg": saved_cfg}, expected)
    check_dictionary(path, vocabulary, dictionary)
    return Source(path, cfg, model_state, dictionary, dict_path, saved_cfg, vocabulary)


# ------------------------------------------------------------------------------------------------ what maps


def _embed_scale(cfg) -> float:
    return 1.0 if cfg.no_scale_embedding else math.sqrt(cfg.decoder_embed_dim)


def _common_problems(src: Source) -> List[str]:
    cfg = src.cfg
    if cfg.adaptive_input or cfg.adaptive_softmax_cutoff is not None:
        return [
            "--adaptive-input / --adaptive-softmax-cutoff (banded embeddings and softmax) have no equivalent "
            "in OPT or XGLM"
        ]
    problems = []
    if src.dictionary.pad() != PAD:
        problems.append(f"the dictionary's padding index is {src.dictionary.pad()}, not {PAD}")
    if cfg.activation_fn not in ACTIVATIONS:
        problems.append(f"--activation-fn {cfg.activation_fn} has no transformers equivalent")
    if cfg.layernorm_embedding:
        problems.append("--layernorm-embedding (a layer norm after the embeddings) has no equivalent in OPT or XGLM")
    normformer = [
        flag
        for flag, on in (
            ("--scale-attn", cfg.scale_attn),
            ("--scale-fc", cfg.scale_fc),
            ("--scale-heads", cfg.scale_heads),
            ("--scale-resids", cfg.scale_resids),
        )
        if on
    ]
    if normformer:
        problems.append(
            f"NormFormer's {' '.join(normformer)} (extra norms and learned scales in each layer) have no "
            "equivalent in OPT or XGLM"
        )
    rows = src.state["decoder.output_projection.weight"].size(0)
    if rows != len(src.dictionary):
        problems.append(
            f"the output projection has {rows} rows for a dictionary of {len(src.dictionary)} "
            "(--output-dictionary-size): transformers predicts the whole vocabulary"
        )
    return problems


def opt_problems(src: Source) -> List[str]:
    """Why `src` cannot be written as OPTForCausalLM (empty: it can, exactly)."""
    cfg = src.cfg
    problems = _common_problems(src)
    if cfg.decoder_input_dim != cfg.decoder_output_dim:
        problems.append(
            f"--decoder-input-dim {cfg.decoder_input_dim} differs from --decoder-output-dim "
            f"{cfg.decoder_output_dim}: OPT projects in and out through one word_embed_proj_dim"
        )
    return problems


def xglm_problems(src: Source) -> List[str]:
    """Why `src` cannot be written as XGLMForCausalLM (empty: it can, exactly)."""
    cfg = src.cfg
    problems = _common_problems(src)
    if not src.has_positions:
        problems.append("--no-token-positional-embeddings: XGLM always adds sinusoidal positions")
    elif src.learned_positions:
        problems.append("--decoder-learned-pos: XGLM's positions are sinusoidal")
    if not cfg.decoder_normalize_before:
        problems.append("post-norm (--decoder-normalize-before off): XGLM is pre-norm only")
    elif cfg.no_decoder_final_norm:
        problems.append("--no-decoder-final-norm: XGLM always applies a final layer norm")
    if cfg.decoder_input_dim != cfg.decoder_embed_dim or cfg.decoder_output_dim != cfg.decoder_embed_dim:
        problems.append(
            f"--decoder-input-dim/--decoder-output-dim ({cfg.decoder_input_dim}/"
            f"{cfg.decoder_output_dim}) differ from --decoder-embed-dim {cfg.decoder_embed_dim}: XGLM "
            "has no input/output projections"
        )
    return problems


def choose_model_type(src: Source, requested: str = "auto") -> str:
    """The target for --model-type `requested` ("opt" or "xglm"); auto: OPT for learned or no positions, XGLM
    for sinusoidal ones when it fits, else OPT with the sinusoidal table written out. Raises ValueError naming
    what has no equivalent."""
    if requested not in MODEL_TYPES:
        raise ValueError(f"--model-type {requested!r}: choose one of {', '.join(MODEL_TYPES)}")
    checks = {"opt": opt_problems, "xglm": xglm_problems}
    if requested != "auto":
        problems = checks[requested](src)
        if problems:
            raise ValueError(f"cannot export {src.path} as {HF_ARCHITECTURES[requested]}: {'; '.join(problems)}")
        return requested
    order = ["xglm", "opt"] if src.has_positions and not src.learned_positions else ["opt"]
    found = {}
    for model_type in order:
        found[model_type] = checks[model_type](src)
        if not found[model_type]:
            return model_type
    # Report each problem once, the candidates' own ones named after them.
    reasons = []
    for model_type in order:
        reasons += [p for p in found[model_type] if p not in reasons]
    raise ValueError(f"cannot export {src.path} to transformers exactly: {'; '.join(reasons)}")


def hf_config(src: Source, model_type: str, dtype: torch.dtype):
    """The transformers config object of the exported model."""
    from transformers import OPTConfig, XGLMConfig  # deferred: optional (the export extra)

    cfg = src.cfg
    common = dict(
        vocab_size=len(src.dictionary),
        activation_function=ACTIVATIONS[cfg.activation_fn],
        layerdrop=0.0,
        use_cache=True,
        pad_token_id=PAD,
        bos_token_id=src.begin_token,
        eos_token_id=src.dictionary.eos(),
        architectures=[HF_ARCHITECTURES[model_type]],
        dtype=dtype,
    )
    common.update({hf_name: getattr(cfg, name) for name, hf_name in CONFIG_FIELDS[model_type]})
    if model_type == "opt":
        return OPTConfig(
            _remove_final_layer_norm=bool(cfg.decoder_normalize_before and cfg.no_decoder_final_norm),
            enable_bias=True,
            layer_norm_elementwise_affine=True,
            tie_word_embeddings=_opt_ties(src),
            **common,
        )
    return XGLMConfig(
        scale_embedding=not cfg.no_scale_embedding,
        activation_dropout=cfg.activation_dropout or cfg.relu_dropout or 0.0,
        decoder_start_token_id=src.begin_token,
        tie_word_embeddings=src.tied,
        **common,
    )


def _opt_ties(src: Source) -> bool:
    # The scale folded into the input embeddings makes them differ from the (unscaled) output matrix.
    return src.tied and _embed_scale(src.cfg) == 1.0


def hf_tensors(src: Source, model_type: str) -> List[TensorSpec]:
    """The exported model's tensors, named as transformers names them (hf_names.weight_names), each computed
    when written."""
    state, cfg = src.state, src.cfg
    opt = model_type == "opt"
    pairs = weight_names(
        model_type,
        cfg.decoder_layers,
        positions=opt,
        project_in=PROJECT_IN in state,
        project_out=PROJECT_OUT in state,
        final_norm="decoder.layer_norm.weight" in state,
        head=not (_opt_ties(src) if opt else src.tied),
    )
    embed, scale = state[EMBED], _embed_scale(cfg)
    specs = []
    for key, hf_name in pairs:
        if key == POSITIONS:
            specs.append(_opt_positions(src, hf_name))
        elif key == EMBED and opt and scale != 1.0:
            # folded in fp32 (fairseq multiplies the looked-up fp32 rows by the same number)
            specs.append(
                TensorSpec(hf_name, tuple(embed.shape), embed.dtype, lambda: (embed.float() * scale).to(embed.dtype))
            )
        else:
            specs.append(TensorSpec(hf_name, tuple(state[key].shape), state[key].dtype, lambda key=key: state[key]))
    return specs


def _opt_positions(src: Source, name: str) -> TensorSpec:
    """OPT's position table: fairseq's learned one as it is, or the sinusoidal rows (zeros without positions)
    for max_target_positions positions after the two offset rows."""
    state, cfg = src.state, src.cfg
    rows, dim = cfg.max_target_positions + PAD + 1, cfg.decoder_embed_dim
    if src.learned_positions:
        table = state["decoder.embed_positions.weight"]
        if tuple(table.shape) != (rows, dim):
            raise ValueError(
                f"{src.path}: decoder.embed_positions.weight is {tuple(table.shape)}, expected "
                f"({rows}, {dim}) for --max-target-positions {cfg.max_target_positions}"
            )
        return TensorSpec(name, (rows, dim), table.dtype, lambda: table)
    dtype = src.state["decoder.embed_tokens.weight"].dtype
    if not src.has_positions:
        return TensorSpec(name, (rows, dim), dtype, lambda: torch.zeros(rows, dim, dtype=dtype))
    return TensorSpec(name, (rows, dim), dtype, lambda: sinusoidal_table(rows, dim, PAD).to(dtype))


# ------------------------------------------------------------------------------------------------ the export


def export(
    checkpoint: str,
    out_dir: str,
    dict_path: Optional[str] = None,
    model_type: str = "auto",
    dtype: Optional[str] = None,
    max_shard_size: str = "5GB",
    bpe: Optional[dict] = None,
    tokenizer: bool = True,
    overwrite: bool = False,
    trust_legacy: bool = False,
) -> Dict[str, object]:
    """Write the transformers directory `out_dir` for `checkpoint`; returns what was written.

    `bpe` is {"_name": "gpt2", "gpt2_encoder_json": ..., "gpt2_vocab_bpe": ...} or {"_name": "sentencepiece",
    "sentencepiece_model": ...}; None takes the checkpoint's saved --bpe, if any. `tokenizer=False` writes no
    tokenizer. The directory is assembled beside `out_dir` and renamed into place when complete.
    """
    require_transformers()
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    max_shard_bytes = parse_size(max_shard_size)
    given_files = [checkpoint, dict_path] + [v for k, v in (bpe or {}).items() if k != "_name"]
    check_output(out_dir, overwrite, "export_hf", given_files)

    src = load_source(checkpoint, dict_path, trust_legacy=trust_legacy)
    chosen = choose_model_type(src, model_type)
    bpe_cfg = export_bpe(bpe, src) if tokenizer else None
    # and the files found (dict.txt beside the checkpoint, the checkpoint's --bpe files): none may be replaced
    check_output(
        out_dir,
        overwrite,
        "export_hf",
        [src.dict_path] + [v for k, v in (bpe_cfg or {}).items() if k != "_name" and isinstance(v, str)],
    )
    # Build the tokenizer before writing anything: its refusal must not leave a half-written export.
    hf_tok = build_hf_tokenizer(bpe_cfg, src) if bpe_cfg is not None else None
    target_dtype = DTYPES[dtype] if dtype else None
    config = hf_config(src, chosen, target_dtype or src.state["decoder.embed_tokens.weight"].dtype)

    # One line for an OSError; an earlier export is kept until the new one is complete.
    with assembled(out_dir, "cannot write the export", "export_hf", "OUTPUT") as tmp:
        files = _write_export(src, chosen, config, hf_tok, bpe_cfg, tmp, target_dtype, max_shard_bytes)
    logger.info(
        f"wrote {out_dir}: {HF_ARCHITECTURES[chosen]}, {len(files)} weight file(s)"
        + (f", tokenizer ({bpe_cfg['_name']})" if hf_tok is not None else ", no tokenizer")
    )
    return {
        "model_type": chosen,
        "architecture": HF_ARCHITECTURES[chosen],
        "weights": files,
        "tokenizer": bpe_cfg["_name"] if hf_tok is not None else None,
    }


def _write_export(src, chosen, config, hf_tok, bpe_cfg, tmp, target_dtype, max_shard_bytes) -> List[str]:
    """Write the export's files into `tmp`. With a tokenizer, the --bpe files themselves go beside dict.txt too
    (under hf_names.FORK_TOKENIZER_FILES' names), for the way back (hf_import)."""
    config.save_pretrained(tmp)
    _generation_config(src).save_pretrained(tmp)
    files = write_shards(tmp, hf_tensors(src, chosen), target_dtype, max_shard_bytes)
    shutil.copyfile(src.dict_path, os.path.join(tmp, "dict.txt"))
    if hf_tok is not None:
        hf_tok.save_pretrained(tmp)
        for filename, option in FORK_TOKENIZER_FILES.items():
            if bpe_cfg.get(option):
                shutil.copyfile(bpe_cfg[option], os.path.join(tmp, filename))
    return files


def _generation_config(src: Source):
    from transformers import GenerationConfig  # deferred: optional (the export extra)

    return GenerationConfig(bos_token_id=src.begin_token, eos_token_id=src.dictionary.eos(), pad_token_id=PAD)
