"""Generation flags (`GenerationConfig`, `InteractiveConfig`), upstream fairseq's names and defaults.

Read by fairseq-generate, fairseq-interactive and the hub interface, which hand `GenerationConfig` to
`task.build_generator`. Upstream features that decode something other than a left-to-right language model
(alignments, lexical constraints, an extra fusion LM, diverse beam search, unknown-word replacement) are
accepted at their defaults and rejected when set (here, `check_generation_config`, or by
`task.build_generator` for the generator's own options).
"""

import math
import sys
from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import List, Literal, Optional

from fairseq.dataclass.batch_flags import check_batch_size, check_buffer_size, check_max_tokens
from fairseq.dataclass.fields import opt
from fairseq.upstream_absent import refused_options


@dataclass
class GenerationConfig:
    beam: int = opt(5, "beam size (1: greedy decoding)")
    nbest: int = opt(1, "number of hypotheses to output per input")
    max_len_a: float = opt(
        0,
        "generate at most a*x + b tokens, where x is the input length (the prompt "
        "counts as generated text for a language model)",
    )
    max_len_b: int = opt(200, "generate at most a*x + b tokens, where x is the input length")
    min_len: int = opt(1, "minimum generation length (</s> is not allowed before)")
    match_source_len: bool = opt(False, "generate exactly as many tokens as the input has")
    unnormalized: bool = opt(False, "compare hypotheses by their summed scores, not per token")
    no_early_stop: bool = opt(False, "deprecated upstream, where it does nothing either")
    no_beamable_mm: bool = opt(
        False, "same as the default here: upstream's BeamableMM (an encoder-attention speed-up) does not exist"
    )
    lenpen: float = opt(
        1, "length penalty: the score is divided by length**lenpen (<1 favours shorter, >1 longer hypotheses)"
    )
    unkpen: float = opt(0, "unknown-word penalty subtracted from <unk>'s log probability (<0: more <unk>)")
    replace_unk: Optional[str] = opt(
        None, "not supported: unknown-word replacement needs source alignments", const="@@ "
    )
    sacrebleu: bool = opt(
        False,
        "upstream: score the output with sacrebleu; here generated text is not scored (a start-up notice says so)",
    )
    score_reference: bool = opt(False, "score the given text instead of generating (the hub's score())")
    prefix_size: int = opt(
        0, "fairseq-generate: prompt each sample with its first N tokens (0: the whole sample but its last token)"
    )
    no_repeat_ngram_size: int = opt(0, "never repeat an n-gram of this size (0: no blocking)")
    sampling: bool = opt(False, "sample each next token instead of beam search")
    sampling_topk: int = opt(-1, "sample from the K most likely next tokens (-1: all)")
    sampling_topp: float = opt(
        -1.0, "sample from the smallest set of next tokens whose probability exceeds p (-1: all)"
    )
    constraints: Optional[Literal["ordered", "unordered"]] = opt(
        None,
        "not supported with --task language_modeling (as upstream): lexically constrained decoding",
        const="ordered",
    )
    temperature: float = opt(
        1.0,
        "divide the logits by this before the softmax (sampling and beam search); at "
        "least 0.0113, below which float32 gives every token but the likeliest probability 0",
    )
    diverse_beam_groups: int = opt(-1, "not supported: number of groups for diverse beam search")
    diverse_beam_strength: float = opt(0.5, "not supported: diversity penalty of diverse beam search")
    diversity_rate: float = opt(-1.0, "not supported: diversity penalty of diverse siblings search")
    print_alignment: bool = opt(False, "not supported: a language model has no source to align to")
    print_step: bool = opt(False, "not supported: the decoding step of iterative refinement")
    lm_path: Optional[str] = opt(None, "not supported: a second language model for shallow fusion")
    lm_weight: float = opt(0.0, "not supported: weight of the --lm-path model")
    retain_dropout: bool = opt(False, "keep dropout active while generating")
    retain_dropout_modules: Optional[List[str]] = opt(
        None,
        "upstream: keep dropout only in these modules; here "
        "--retain-dropout keeps every module's dropout (a "
        "start-up notice says so)",
    )
    no_seed_provided: bool = opt(False, "do not seed the random generators from --seed")
    text_only: bool = opt(
        False,
        "fairseq-generate/-interactive: print only each hypothesis' detokenized text (the "
        "D- line's text), one line per hypothesis (--nbest per prompt, best first); the log goes to stderr",
    )
    stream: bool = opt(
        False,
        "fairseq-interactive: print each prompt's text while it is generated, a piece every "
        "16 tokens (the --text-only line; the log goes to stderr); needs --beam 1 (greedy "
        "or --sampling)",
    )
    no_cuda_graphs: bool = opt(
        False,
        "decode each step eagerly instead of replaying it from a CUDA graph (on "
        "CUDA, this fork's decoders; see docs/incremental_decoding.md)",
    )
    quantize: Literal["none", "int8-weight-only"] = opt(
        "none",
        "int8-weight-only: the Linear weights in int8 (weight-only, one scale per row, a fused int8 "
        "matmul) after the model is loaded: half the weight bytes read per decoded token; needs CUDA and "
        "--bf16; see docs/generation.md",
    )


@dataclass
class InteractiveConfig:
    buffer_size: int = opt(0, "read this many input lines before generating for them (0 or 1: one at a time)")
    input: str = opt("-", "file to read prompts from, one per line ('-': standard input)")


def as_generation_config(args) -> GenerationConfig:
    """`args` as a GenerationConfig, for task.build_generator: upstream callers pass an argparse Namespace or a
    DictConfig, which may lack options or hold None; those take the dataclass's defaults (the only ones)."""
    values = {f.name: getattr(args, f.name, None) for f in fields(GenerationConfig)}
    return GenerationConfig(**{name: value for name, value in values.items() if value is not None})


# Upstream options this fork does not implement (the one table; the generator's own are checked by
# task.build_generator and the SequenceGenerator).
_UNSUPPORTED = refused_options("generation")


def check_unsupported_options(generation) -> None:
    """Raise ValueError naming the flag for an upstream option that is set but not implemented here."""
    for name, is_set, fix in _UNSUPPORTED:
        value = getattr(generation, name, None)
        if value is not None and is_set(value):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value!r} is not supported by this fairseq's generator; {fix}")


# The numeric options checked before any decoding: (integer?, the values allowed, whether a value is in range).
# A float must be finite; the sampling ranges and --temperature > 0 are check_sampling_range's.
_NUMBERS = {
    "beam": (True, "an integer, at least 1 (1: greedy decoding)", lambda v: v >= 1),
    "nbest": (True, "an integer, at least 1", lambda v: v >= 1),
    "max_len_a": (False, "a finite number (outputs have at most a * input length + b tokens)", None),
    "max_len_b": (True, "an integer (outputs have at most a * input length + b tokens)", None),
    "min_len": (True, "an integer (no </s> before that many tokens)", None),
    "prefix_size": (True, "an integer, 0 or more", lambda v: v >= 0),
    "no_repeat_ngram_size": (True, "an integer, 0 (off) or more", lambda v: v >= 0),
    "lenpen": (False, "a finite number (the score is divided by length**lenpen; 1: per token)", None),
    "unkpen": (False, "a finite number (subtracted from <unk>'s log probability; 0: none)", None),
    "sampling_topk": (True, "an integer: -1 (off: all tokens) or a number of tokens, at least 1", None),
    "sampling_topp": (False, "a number: -1 (off: all tokens) or a probability mass in (0, 1]", None),
    "temperature": (False, "a finite number greater than 0 (1: the model's distribution)", None),
}


def check_option_values(generation, keyword: bool = False) -> None:
    """The numeric generation options (_NUMBERS) are numbers of their type (an integer where one is counted;
    the hub's keyword arguments are not converted as flags are), finite, and in the range that needs no model.
    One ValueError naming the option, the value and what is allowed; `keyword`: the hub's keyword names."""
    for field, (integer, allowed, in_range) in _NUMBERS.items():
        value = getattr(generation, field, None)
        if value is None:
            continue
        label = f"{field}={value!r}" if keyword else f"--{field.replace('_', '-')} {value}"
        number = isinstance(value, Integral if integer else Real) and not isinstance(value, bool)
        if not number:
            raise ValueError(f"{label} must be {allowed}")
        if not math.isfinite(value) or (in_range is not None and not in_range(value)):
            raise ValueError(f"{label} is out of range: {allowed}")
    a, b = getattr(generation, "max_len_a", None), getattr(generation, "max_len_b", None)
    if a is not None and b is not None and a <= 0 and b < 0:  # no prompt length gives an output room
        a_name, b_name = ("max_len_a=", "max_len_b=") if keyword else ("--max-len-a ", "--max-len-b ")
        raise ValueError(
            f"{b_name}{b} is out of range: outputs have at most {a_name.strip(' =')} * input length + "
            f"{b_name.strip(' =')} tokens (the prompt included), below 0 with {a_name}{a}; give "
            f"{b_name}0 or more"
        )


# The largest value of the dtypes log-probabilities are computed in (torch.finfo(...).max): float32 at least, as
# the models' get_normalized_probs upcast fp16/bf16 logits; float64 for a model cast to it.
FLOAT_MAX = {"float32": 3.4028234663852886e38, "float64": sys.float_info.max}


def smallest_temperature(dtype: str = "float32") -> float:
    """The smallest --temperature whose probabilities `dtype` can hold: below 1/ln(its largest value), two
    tokens one logit apart are, divided by the temperature, more than ln(largest) apart, so the ratio of their
    probabilities exceeds the dtype: every token but the likeliest gets probability 0 (and a score near -1e9
    where one is forced). 0.0113 for float32, 0.0014 for float64."""
    return 1 / math.log(FLOAT_MAX[dtype])


def check_sampling_range(
    sampling_topk: Optional[int] = -1,
    sampling_topp: Optional[float] = -1.0,
    temperature: Optional[float] = 1.0,
    vocab_size: Optional[int] = None,
    keyword: bool = False,
    probability_dtype: str = "float32",
) -> None:
    """Upstream's ranges: --sampling-topk -1 (off) or 1.. (at most `vocab_size` when known), --sampling-topp -1
    (off) or in (0, 1], --temperature > 0 (the generator's rule, checked here before any model is loaded), and
    --temperature at least smallest_temperature(`probability_dtype`), the dtype the probabilities are computed
    in. `keyword`: name the hub's keyword arguments instead of the flags."""
    topk, topp = sampling_topk, sampling_topp

    def name(field):
        return f"{field}=" if keyword else "--" + field.replace("_", "-") + " "

    top = f"1 to the vocabulary size {vocab_size}" if vocab_size else "at least 1"
    if topk is not None and not (topk == -1 or 1 <= topk <= (vocab_size or topk)):
        raise ValueError(
            f"{name('sampling_topk')}{topk} is out of range: -1 (off: all tokens) or a number of tokens, {top}"
        )
    if topp is not None and not (topp == -1 or 0 < topp <= 1):
        raise ValueError(
            f"{name('sampling_topp')}{topp} is out of range: -1 (off: all tokens) or a probability mass in (0, 1]"
        )
    if temperature is not None and not temperature > 0:  # NaN too
        raise ValueError(
            f"{name('temperature')}{temperature} is out of range: the logits are divided by it, so it "
            "must be greater than 0 (1: the model's distribution; below 1 sharper, above 1 flatter)"
        )
    least = smallest_temperature(probability_dtype)
    if temperature is not None and temperature < least:
        greedy = "beam=1 without sampling=True" if keyword else "--beam 1 without --sampling"
        raise ValueError(
            f"{name('temperature')}{temperature:g} is below {least:.4f} (1/ln of {FLOAT_MAX[probability_dtype]:.4g}, "
            f"the largest {probability_dtype}, which the probabilities are computed in): divided by it, logits one "
            f"apart give probabilities whose ratio no {probability_dtype} holds, so every token but the likeliest "
            f"gets probability 0 (scores near -1e9); pass at least {least:.4f}, or {greedy} for greedy decoding"
        )


def check_generation_config(generation: GenerationConfig, dataset=None, interactive=None) -> None:
    """fairseq-generate's and fairseq-interactive's checks: the batch options of `dataset` and `interactive`
    (fairseq.dataclass.batch_flags), unsupported options, then upstream's rules for what is printed (--nbest
    against --beam; with `dataset` and `interactive`, --batch-size against --buffer-size). The hub interface,
    which prints nothing, checks only the unsupported options, the numeric options and the sampling ranges."""
    if dataset is not None:
        check_max_tokens(dataset.max_tokens)
        check_batch_size(dataset.batch_size)
    if interactive is not None:
        check_buffer_size(interactive.buffer_size)
    check_unsupported_options(generation)
    check_option_values(generation)
    check_sampling_range(generation.sampling_topk, generation.sampling_topp, generation.temperature)
    if generation.nbest < 1:
        raise ValueError(f"--nbest must be at least 1, got {generation.nbest}")
    if generation.sampling and generation.nbest != generation.beam:
        raise ValueError(
            f"--sampling requires --nbest to be equal to --beam (got --nbest {generation.nbest}, "
            f"--beam {generation.beam}): --beam N --nbest N draws N samples per prompt"
        )
    if generation.nbest > generation.beam >= 1:
        raise ValueError(
            f"--nbest {generation.nbest} is larger than --beam {generation.beam}: a beam search "
            "returns at most --beam hypotheses; raise --beam or lower --nbest"
        )
    if generation.stream and (interactive is None or generation.beam != 1):
        raise ValueError(
            "--stream is fairseq-interactive's, with --beam 1 (greedy or --sampling): drop --stream, "
            "or use fairseq-interactive --beam 1"
            if interactive is None
            else f"--stream needs --beam 1 (greedy or --sampling), got --beam {generation.beam}"
        )
    if generation.prefix_size < 0:
        raise ValueError(f"--prefix-size must be >= 0, got {generation.prefix_size}")
    if interactive is not None and dataset is not None and dataset.batch_size:
        if dataset.batch_size > max(interactive.buffer_size, 1):
            raise ValueError(
                f"--batch-size/--max-sentences {dataset.batch_size} cannot be larger than "
                f"--buffer-size {interactive.buffer_size}; raise --buffer-size to at least "
                f"{dataset.batch_size}"
            )
