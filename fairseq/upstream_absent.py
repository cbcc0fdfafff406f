"""What of upstream fairseq this fork leaves out on purpose: the one table (modules, names, options), and the
ImportError that says so. A plain data table at the bottom layer, so the core's checks read it.

This fork trains and serves decoder-only language models; upstream's translation, speech, encoder-only /
encoder-decoder models, non-autoregressive and Megatron model-parallel code, TPU support and BLEU scoring
are not part of it (docs/CONTRACTS.md lists them with the reasons). Code written for upstream that imports
one of them gets an ImportError naming what is absent and what to use instead, rather than a bare
"No module named ..." that reads like a broken install:

- a whole module (`import fairseq.tasks.translation`): `AbsentModuleFinder`, installed once on `sys.meta_path`
  by `import fairseq`; it is consulted last, so it never hides a module that exists;
- a name in a package that exists (`from fairseq.models import TransformerModel`): the package's module-level
  `__getattr__` calls `absent_name`;
- upstream's names that the compat wing (fairseq/compat/) serves inside the core's packages
  (IN_THE_WING_NAMES, IN_THE_WING_MODULES): the same `__getattr__` and finder load the wing's module on first use;
- an option: REFUSED_OPTIONS (set, it is an error naming the flag; read by each component's check) and
  ACCEPTED_OPTIONS (set, one info line at start-up says what happens instead).
"""

import importlib.abc
import importlib.machinery
import sys

# Why a family is absent, and what to use instead (the second half of every message).
_LM = "it trains decoder-only (left-to-right) language models"
_TRANSLATION = (
    f"{_LM} and has no translation (source/target pairs); use --task language_modeling "
    "(fairseq.tasks.language_modeling.LanguageModelingTask)"
)
_SPEECH = f"{_LM} on text and has no speech or audio models, tasks and datasets"
_ENCODER = (
    f"{_LM} and has no encoder or encoder-decoder architectures (only upstream's base classes "
    "fairseq.models.FairseqEncoder / FairseqEncoderDecoderModel, for plug-ins); use "
    "fairseq.models.transformer_lm.TransformerLanguageModel (--arch transformer_lm*) and its decoder "
    "fairseq.modules.TransformerDecoder, or subclass fairseq.models.FairseqLanguageModel with a "
    "fairseq.models.FairseqIncrementalDecoder"
)
_FCONV = (
    f"{_LM} and has no convolutional encoder-decoder (translation) models; its gated convolutional "
    "language model is fairseq.models.fconv_lm (FConvLanguageModel, FConvDecoder; --arch fconv_lm, "
    "fconv_lm_dauphin_wikitext103, fconv_lm_dauphin_gbw)"
)
_MASKED_LM = (
    f"{_LM} and has no masked or denoising pretraining (BERT, RoBERTa, BART); use --task "
    "language_modeling with --arch transformer_lm*"
)
_NAT = f"{_LM} and has no non-autoregressive models"
_MODEL_PARALLEL = "it has no Megatron model parallelism; shard large models with --ddp-backend fully_sharded (FSDP2)"
_TPU = "it has no TPU (torch_xla) support; train on CUDA GPUs or the CPU"
_SCORING = "it has no BLEU / translation scoring; evaluate language models with fairseq-eval-lm or fairseq-validate"
_LIGHTCONV = (
    f"{_LM} and has no lightweight / dynamic convolution models (lightconv, lightconv_lm); its "
    "convolutional language model is fairseq.models.fconv_lm (fairseq.modules.gated_convolution)"
)
_QUANT = (
    "it has no quantization-aware training (iterative PQ, scalar quantization noise); "
    "fairseq.modules.quant_noise accepts p=0 only; a trained model's weights are quantized for generation with "
    "--quantize int8-weight-only"
)

ABSENT_MODULES = {
    # tasks
    **{
        f"fairseq.tasks.{m}": _TRANSLATION
        for m in (
            "translation",
            "translation_multi_simple_epoch",
            "multilingual_translation",
            "semisupervised_translation",
            "translation_from_pretrained_bart",
            "translation_from_pretrained_xlm",
            "translation_lev",
            "online_backtranslation",
            "simultaneous_translation",
        )
    },
    **{
        f"fairseq.tasks.{m}": _SPEECH
        for m in (
            "speech_to_text",
            "speech_to_speech",
            "text_to_speech",
            "frm_text_to_speech",
            "audio_pretraining",
            "audio_finetuning",
            "audio_classification",
            "hubert_pretraining",
            "speech_ulm_task",
            "speech_dlm_task",
        )
    },
    **{
        f"fairseq.tasks.{m}": _MASKED_LM
        for m in (
            "masked_lm",
            "multilingual_masked_lm",
            "legacy_masked_lm",
            "cross_lingual_lm",
            "denoising",
            "multilingual_denoising",
            "span_masked_lm",
            "sentence_prediction",
            "sentence_prediction_adapters",
            "sentence_ranking",
        )
    },
    # models
    **{
        f"fairseq.models.{m}": _ENCODER
        for m in (
            "transformer",
            "transformer_legacy",
            "composite_encoder",
            "fconv_self_att",
            "lstm",
            "lightconv",
            "multilingual_transformer",
            "transformer_align",
            "transformer_from_pretrained_xlm",
            "masked_lm",
        )
    },
    "fairseq.models.fconv": _FCONV,
    **{f"fairseq.models.{m}": _MASKED_LM for m in ("roberta", "bart", "xmod")},
    **{
        f"fairseq.models.{m}": _SPEECH
        for m in ("wav2vec", "hubert", "speech_to_text", "speech_to_speech", "text_to_speech", "speech_dlm")
    },
    "fairseq.models.nat": _NAT,
    "fairseq.model_parallel": _MODEL_PARALLEL,
    # data, criterions, scoring
    "fairseq.data.audio": _SPEECH,
    "fairseq.data.backtranslation_dataset": _TRANSLATION,
    "fairseq.data.round_robin_zip_datasets": _TRANSLATION,
    "fairseq.data.mask_tokens_dataset": _MASKED_LM,
    "fairseq.data.denoising_dataset": _MASKED_LM,
    "fairseq.criterions.label_smoothed_cross_entropy": _TRANSLATION,
    "fairseq.criterions.masked_lm": _MASKED_LM,
    "fairseq.criterions.sentence_prediction": _MASKED_LM,
    "fairseq.criterions.ctc": _SPEECH,
    "fairseq.criterions.wav2vec_criterion": _SPEECH,
    "fairseq.criterions.nat_loss": _NAT,
    "fairseq.scoring": _SCORING,
    # modules
    **{
        f"fairseq.modules.{m}": _ENCODER
        for m in (
            "transformer_sentence_encoder",
            "transformer_sentence_encoder_layer",
            "sparse_transformer_sentence_encoder",
            "sparse_transformer_sentence_encoder_layer",
            "sparse_multihead_attention",
            "transformer_layer_resampling",
            "linformer_sentence_encoder",
            "linformer_sentence_encoder_layer",
        )
    },
    **{
        f"fairseq.modules.{m}": _SPEECH
        for m in (
            "espnet_multihead_attention",
            "conformer_layer",
            "positional_encoding",
            "vggblock",
            "location_attention",
            "lstm_cell_with_zoneout",
            "gumbel_vector_quantizer",
            "kmeans_vector_quantizer",
            "fp32_batch_norm",
            "fp32_instance_norm",
            "ema_module",
        )
    },
    **{
        f"fairseq.modules.{m}": _FCONV
        for m in ("conv_tbc", "linearized_convolution", "beamable_mm", "downsampled_multihead_attention", "scalar_bias")
    },
    **{
        f"fairseq.modules.{m}": _LIGHTCONV
        for m in ("lightweight_convolution", "dynamic_convolution", "unfold", "lightconv_layer", "dynamicconv_layer")
    },
    "fairseq.modules.dynamic_crf_layer": _NAT,
    "fairseq.modules.quantization": _QUANT,
    "fairseq.modules.character_token_embedder": "it has no character CNN token embeddings (transformer_lm "
    "refuses --character-embeddings); embed --bpe tokens instead",
    "fairseq.modules.base_layer": "it has no BASE layers (transformer_lm refuses --base-layers)",
}

# (package, name) -> why, for names imported from a package that exists.
ABSENT_NAMES = {
    **{
        ("fairseq.models", n): _ENCODER
        for n in ("TransformerModel", "FairseqEncoderModel", "FairseqModel", "FairseqMultiModel", "CompositeEncoder")
    },
    **{
        ("fairseq.data", n): _TRANSLATION
        for n in (
            "BacktranslationDataset",
            "RoundRobinZipDatasets",
            "TransformEosLangPairDataset",
            "MultilingualDataset",
        )
    },
    **{("fairseq.data", n): _MASKED_LM for n in ("MaskTokensDataset", "DenoisingDataset")},
    **{("fairseq.data", n): _SPEECH for n in ("FileAudioDataset", "RawAudioDataset", "AddTargetDataset")},
    **{("fairseq.tasks", n): _TRANSLATION for n in ("TranslationTask",)},
    **{("fairseq.utils", n): _TPU for n in ("xla_device_to_cpu", "is_xla_tensor", "get_tpu_device", "tpu_data_loader")},
    # upstream's fairseq.modules.__all__ (and the names it imports) that plug-in LMs do not build on here
    **{
        ("fairseq.modules", n): _ENCODER
        for n in ("TransformerEncoderLayer", "TransformerSentenceEncoder", "TransformerSentenceEncoderLayer")
    },
    **{
        ("fairseq.modules", n): _SPEECH
        for n in (
            "ESPNETMultiHeadedAttention",
            "RelPositionMultiHeadedAttention",
            "RotaryPositionMultiHeadedAttention",
            "ConformerEncoderLayer",
            "RelPositionalEncoding",
            "VGGBlock",
            "LocationAttention",
            "LSTMCellWithZoneOut",
            "GumbelVectorQuantizer",
            "KmeansVectorQuantizer",
            "Fp32BatchNorm",
            "Fp32InstanceNorm",
            "SamePad2d",
            "EMAModule",
            "EMAModuleConfig",
        )
    },
    **{
        ("fairseq.modules", n): _FCONV
        for n in ("ConvTBC", "LinearizedConvolution", "BeamableMM", "DownsampledMultiHeadAttention", "ScalarBias")
    },
    **{
        ("fairseq.modules", n): _LIGHTCONV
        for n in (
            "LightweightConv",
            "LightweightConv1dTBC",
            "DynamicConv",
            "DynamicConv1dTBC",
            "DynamicConv_scripatable",
            "unfold1d",
        )
    },
    ("fairseq.modules", "DynamicCRF"): _NAT,
    ("fairseq.modules", "CharacterTokenEmbedder"): ABSENT_MODULES["fairseq.modules.character_token_embedder"],
    ("fairseq.modules", "BaseLayer"): ABSENT_MODULES["fairseq.modules.base_layer"],
}


# Upstream options that are refused when set: (where, field, is it set (on a value that is not None), what to do
# instead). Where: "generation" (the generation group: fairseq-generate/-interactive and the hub), "generator"
# (task.build_generator's arguments), "transformer_lm" (the model's check_config), "preprocess"
# (fairseq-preprocess's check_args).
REFUSED_OPTIONS = (
    ("generation", "replace_unk", lambda v: v is not None, "drop it"),
    ("generation", "print_alignment", bool, "drop it"),
    ("generation", "print_step", bool, "drop it"),
    ("generation", "lm_path", lambda v: v is not None, "drop it"),
    ("generator", "diverse_beam_groups", lambda v: v > 0, "use --beam or --sampling"),
    ("generator", "diversity_rate", lambda v: v > 0, "use --beam or --sampling"),
    ("generator", "constraints", bool, "drop it"),
    *(
        (
            "preprocess",
            name,
            lambda v: v is not None,
            "word alignments pair source and target tokens (translation); language-modeling text has none: drop it",
        )
        for name in ("align_suffix", "alignfile")
    ),
    *(
        ("transformer_lm", name, is_set, "leave it at its default")
        for name, is_set in (
            ("character_embeddings", bool),
            ("decoder_layerdrop", lambda v: v > 0),
            ("decoder_layers_to_keep", lambda v: v is not None),
            ("quant_noise_pq", lambda v: v > 0),
            ("quant_noise_scalar", lambda v: v > 0),
            ("base_layers", lambda v: v > 0),
        )
    ),
)

# Upstream options accepted (so upstream command lines run unchanged) whose behaviour this fork does not have:
# (group, field, what happens instead). Set to anything but its default, each is announced in one line at
# start-up (fairseq.dataclass.notices.announce_compat_options); options whose result here is the same say so in
# their help instead.
ACCEPTED_OPTIONS = (
    ("common", "suppress_crashes", "a failing run raises its error and exits non-zero, as without the flag"),
    (
        "distributed_training",
        "fix_batches_to_gpus",
        "each epoch's batches are shuffled across all data-parallel ranks, not kept on one rank",
    ),
    (
        "distributed_training",
        "min_params_to_wrap",
        "fully_sharded makes each transformer layer one FSDP unit (and the rest the root unit), whatever its size",
    ),
    *(
        (
            "preprocess",
            name,
            "language-modeling data (--only-source) has no target dictionary; upstream ignores it there too",
        )
        for name in ("thresholdtgt", "nwordstgt")
    ),
    (
        "preprocess",
        "tgtdict",
        "with --only-source there is no target dictionary: it is read only with "
        "--joined-dictionary (as the dictionary, when --srcdict is not given), as upstream",
    ),
    (
        "eval_lm",
        "softmax_batch",
        "the log-softmax of a batch is computed at once; lower --max-tokens or --batch-size to bound its memory",
    ),
    ("generation", "sacrebleu", "generated text is printed, not scored with BLEU"),
    (
        "generation",
        "retain_dropout_modules",
        "with --retain-dropout every module keeps its dropout; the list is not applied",
    ),
)


def refused_options(where: str):
    """(field, is set, what to do instead) of REFUSED_OPTIONS for one component."""
    return tuple((name, is_set, fix) for place, name, is_set, fix in REFUSED_OPTIONS if place == where)


def message(what: str, why: str) -> str:
    return f"{what} is not part of this fairseq fork: {why}"


# Upstream's surface that lives in the compat wing (fairseq/compat/), under upstream's names in the core's
# packages: module name -> the wing's module, and (package or module, name) -> the wing's module holding the name.
# The core never imports the wing for its own work; these names load it on first use (the one declared upward
# import: scripts/check_structure.py EXCEPTIONS). A file at the upstream path would make its core folder import
# the wing.
IN_THE_WING_MODULES = {
    "fairseq.modules.multihead_attention": "fairseq.compat.multihead_attention",
    "fairseq.data.language_pair_dataset": "fairseq.compat.language_pair_dataset",
    "fairseq.models.fairseq_encoder": "fairseq.compat.fairseq_encoder",
    "fairseq.optim.fp16_optimizer": "fairseq.compat.fp16_optimizer",
    "fairseq.models.ema": "fairseq.compat.ema",  # a package: its submodule `ema` is fairseq.training.ema
}
IN_THE_WING_NAMES = {
    ("fairseq.modules", "MultiheadAttention"): "fairseq.compat.multihead_attention",
    ("fairseq.data", "LanguagePairDataset"): "fairseq.compat.language_pair_dataset",
    ("fairseq.models", "FairseqEncoder"): "fairseq.compat.fairseq_encoder",
    ("fairseq.models", "FairseqEncoderDecoderModel"): "fairseq.compat.fairseq_encoder",
    ("fairseq.models.fairseq_model", "FairseqEncoderDecoderModel"): "fairseq.compat.fairseq_encoder",
    ("fairseq.tasks", "LegacyFairseqTask"): "fairseq.compat.tasks",
    ("fairseq.tasks.fairseq_task", "LegacyFairseqTask"): "fairseq.compat.tasks",
}


def _from_the_wing(module: str):
    from fairseq import compat  # deferred: upward (the wing; declared in scripts/check_structure.py)

    return compat.load(module)


class _WingLoader(importlib.abc.Loader):
    """Serves an upstream module name with the wing's module object (the same object: patching either name
    patches both)."""

    def __init__(self, module: str):
        self.module = module

    def create_module(self, spec):
        return _from_the_wing(self.module)

    def exec_module(self, module):
        pass


class AbsentModuleFinder(importlib.abc.MetaPathFinder):
    """Serves upstream's module names of IN_THE_WING_MODULES from the compat wing, and raises the explaining
    ImportError for a module of ABSENT_MODULES (or inside one) that no other finder found."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in IN_THE_WING_MODULES:
            return importlib.machinery.ModuleSpec(fullname, _WingLoader(IN_THE_WING_MODULES[fullname]))
        for module, why in ABSENT_MODULES.items():
            if fullname == module or fullname.startswith(module + "."):
                raise ModuleNotFoundError(message(f"upstream module {module}", why), name=fullname)
        return None


def install() -> None:
    if not any(isinstance(finder, AbsentModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(AbsentModuleFinder())


def absent_name(package: str, name: str):
    """For a package's `__getattr__`: upstream's name from the compat wing (IN_THE_WING_NAMES), else raise the
    explaining ImportError for an absent upstream name, else the usual AttributeError."""
    wing = IN_THE_WING_NAMES.get((package, name))
    if wing is not None:
        value = getattr(_from_the_wing(wing), name)
        setattr(sys.modules[package], name, value)  # found once
        return value
    why = ABSENT_NAMES.get((package, name))
    if why is not None:
        raise ImportError(message(f"upstream's {package}.{name}", why), name=package)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
