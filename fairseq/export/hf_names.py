"""The one table of names between this fork's transformer_lm and transformers' OPT / XGLM, read both ways: by
the export (hf.py: fork -> transformers) and by the import (hf_import.py: transformers -> fork).

Weights (`weight_names`): fork key <-> transformers key, in transformers' order. Config fields (`CONFIG_FIELDS`):
the values copied as they are. Activations: `ACTIVATIONS` (fork -> transformers' ACT2FN name of the same
function) and `FORK_ACTIVATIONS` (the way back; every tanh approximation of GELU is the fork's gelu_accurate).
What is not a plain copy (OPT's folded embedding scale, its position table, tying) is each side's own code.
"""

from typing import List, Tuple

HF_ARCHITECTURES = {"opt": "OPTForCausalLM", "xglm": "XGLMForCausalLM"}
PAD = 1  # both targets put padding at id 1 and start positions at 2, as fairseq does with its dictionary

# --activation-fn -> transformers' ACT2FN name computing the same function (gelu_fast is gelu_accurate).
ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_accurate": "gelu_pytorch_tanh",
    "gelu_fast": "gelu_pytorch_tanh",
    "tanh": "tanh",
    "linear": "linear",
}
FORK_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_accurate",
    "gelu_new": "gelu_accurate",
    "gelu_fast": "gelu_accurate",
    "gelu_accurate": "gelu_accurate",
    "tanh": "tanh",
    "linear": "linear",
}

# (fork model config field, transformers config field) whose values are the same on both sides.
CONFIG_FIELDS = {
    "opt": (
        ("decoder_embed_dim", "hidden_size"),
        ("decoder_layers", "num_hidden_layers"),
        ("decoder_ffn_embed_dim", "ffn_dim"),
        ("decoder_attention_heads", "num_attention_heads"),
        ("decoder_normalize_before", "do_layer_norm_before"),
        ("decoder_input_dim", "word_embed_proj_dim"),
        ("max_target_positions", "max_position_embeddings"),
        ("dropout", "dropout"),
        ("attention_dropout", "attention_dropout"),
    ),
    "xglm": (
        ("decoder_embed_dim", "d_model"),
        ("decoder_layers", "num_layers"),
        ("decoder_ffn_embed_dim", "ffn_dim"),
        ("decoder_attention_heads", "attention_heads"),
        ("max_target_positions", "max_position_embeddings"),
        ("dropout", "dropout"),
        ("attention_dropout", "attention_dropout"),
    ),
}

# The --bpe files of a model directory, under the names upstream and the hub look for (file name -> --bpe option):
# the export writes them beside dict.txt, the import reads them back, from_pretrained finds them.
FORK_TOKENIZER_FILES = {
    "sentencepiece.bpe.model": "sentencepiece_model",
    "encoder.json": "gpt2_encoder_json",
    "vocab.bpe": "gpt2_vocab_bpe",
}

EMBED = "decoder.embed_tokens.weight"
POSITIONS = "decoder.embed_positions.weight"
PROJECT_IN = "decoder.project_in_dim.weight"
PROJECT_OUT = "decoder.project_out_dim.weight"
FINAL_NORM = "decoder.layer_norm"
OUTPUT = "decoder.output_projection.weight"
LAYER_PARAMS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.out_proj",
    "self_attn_layer_norm",
    "fc1",
    "fc2",
    "final_layer_norm",
)

_PREFIX = {"opt": "model.decoder.", "xglm": "model."}
_HF_FINAL_NORM = {"opt": "final_layer_norm", "xglm": "layer_norm"}


def weight_names(
    model_type: str, layers: int, *, positions: bool, project_in: bool, project_out: bool, final_norm: bool, head: bool
) -> List[Tuple[str, str]]:
    """(fork state-dict key, transformers key) of each weight the model holds: the token embeddings, OPT's
    position table (`positions`), the bias-free input/output projections, every layer's attention, norms and
    feed-forward, the final layer norm and the untied output matrix (`head`)."""
    base = _PREFIX[model_type]
    pairs = [(EMBED, base + "embed_tokens.weight")]
    if positions:
        pairs.append((POSITIONS, base + "embed_positions.weight"))
    if project_in:
        pairs.append((PROJECT_IN, base + "project_in.weight"))
    if project_out:
        pairs.append((PROJECT_OUT, base + "project_out.weight"))
    for i in range(layers):
        for param in LAYER_PARAMS:
            for kind in ("weight", "bias"):
                pairs.append((f"decoder.layers.{i}.{param}.{kind}", f"{base}layers.{i}.{param}.{kind}"))
    if final_norm:
        pairs += [(f"{FINAL_NORM}.{kind}", f"{base}{_HF_FINAL_NORM[model_type]}.{kind}") for kind in ("weight", "bias")]
    if head:
        pairs.append((OUTPUT, "lm_head.weight"))
    return pairs
