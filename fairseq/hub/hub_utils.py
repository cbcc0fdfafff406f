"""The hub interface: a trained model as an object that encodes, generates, scores and decodes text.

    from fairseq.models.transformer_lm import TransformerLanguageModel
    lm = TransformerLanguageModel.from_pretrained("checkpoints", "checkpoint_best.pt", data_name_or_path="data-bin",
                                                  bpe="gpt2", gpt2_encoder_json="gpt2_bpe/encoder.json",
                                                  gpt2_vocab_bpe="gpt2_bpe/vocab.bpe")
    lm.sample("Barack Obama", beam=1, sampling=True, sampling_topk=10, temperature=0.8)
    lm.score("Barack Obama is coming to Sydney")["positional_scores"]   # log p of each token (natural log)

Upstream's `GeneratorHubInterface` and `from_pretrained` (fairseq.hub.pretrained: local directories only, nothing
is downloaded). Text goes tokenizer -> BPE -> dictionary ids (`encode`) and back (`decode`, fairseq.hub.text);
generation uses the task's `build_generator` / `build_dataset_for_inference` / `inference_step`, as
fairseq-interactive does.
"""

import copy
import logging
import queue
import threading
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn

from fairseq.data.batching import resolve_limit
from fairseq.dataclass.batch_flags import check_batch_size, check_max_tokens
from fairseq.dataclass.generation import (
    GenerationConfig,
    check_option_values,
    check_sampling_range,
    check_unsupported_options,
)
from fairseq.generation import device_decoding
from fairseq.generation.decode_memory import check_decode_memory, decode_positions
from fairseq.generation.quantize import check_mode, quantize_for_generation
from fairseq.generation.search import Sampling
from fairseq.generation.sequence_generator import SequenceGenerator
from fairseq.hub.hub_inputs import (
    check_prompt_ids,
    check_prompt_lengths,
    check_seed,
    check_stream_beam,
    prompt_list,
    sentence_list,
)

# from_pretrained is upstream's name here; the rest are this module's names that callers import
from fairseq.hub.pretrained import from_pretrained  # noqa: F401 (upstream's fairseq.hub_utils.from_pretrained)
from fairseq.hub.text import TextCodec, TextPieces, first_streamed_hypothesis, move_to

logger = logging.getLogger("fairseq.hub_utils")  # upstream's logger name: log lines read as its


class GeneratorHubInterface(nn.Module):
    """Upstream's interface for generating from (and scoring with) a language model or an ensemble.

    An nn.Module, so `.cuda()`, `.half()`, `.to(torch.bfloat16)` move and cast every model; `device` is where
    they are. Models are in eval mode (dropout off, unless cfg.generation.retain_dropout) for every call.

    The generator of a set of generation options is built once and kept (`generator_for`): later calls with
    the same options reuse it, with its KV caches and, on CUDA, its captured decode steps. The last
    `max_cached_generators` are kept; moving or casting the interface drops them all.

    `quantize(mode)` (or `from_pretrained(..., quantize="int8-weight-only")`, applied at the first generate
    call) makes the Linear weights int8 on the device the models are on; move and cast first:
    `lm.cuda().to(torch.bfloat16)`. A quantized interface is not moved or cast again."""

    max_cached_generators = 4

    def __init__(self, cfg, task, models):
        super().__init__()
        self.cfg = cfg
        self.task = task
        self.models = nn.ModuleList(models)
        self.src_dict = task.source_dictionary
        self.tgt_dict = task.target_dictionary
        self.retain_dropout = bool(cfg.generation.retain_dropout)
        self._set_model_modes()
        # generation options -> the generator built for them, most recently used last (see generator_for)
        self._generators: "OrderedDict[tuple, Any]" = OrderedDict()
        self.codec = TextCodec(cfg.tokenizer, cfg.bpe)
        self.tokenizer, self.bpe = self.codec.tokenizer, self.codec.bpe  # upstream's attributes
        self.max_positions = resolve_limit(task.max_positions(), *[m.max_positions() for m in models])
        # tells the device (and dtype) the models are on
        self.register_buffer("_float_tensor", torch.tensor([0], dtype=torch.float))
        self.quantized = "none"  # what quantize() applied
        check_mode(cfg.generation.quantize, keyword=True)  # from_pretrained(quantize=...): applied when generating

    @property
    def device(self) -> torch.device:
        return self._float_tensor.device

    def _apply(self, fn, *args, **kwargs):
        if self.quantized != "none":
            raise ValueError(
                f"this interface's models are quantized ({self.quantized}): move and cast them before "
                "quantizing, e.g. from_pretrained(..., quantize=...).cuda().to(torch.bfloat16), then "
                "generate"
            )
        # .to() / .cuda() / .half() ...: the kept generators' caches and graphs belong to the old tensors.
        self._generators.clear()
        return super()._apply(fn, *args, **kwargs)

    def quantize(self, mode: str = "int8-weight-only") -> "GeneratorHubInterface":
        """Quantize the models' Linear weights in place for generation (fairseq.generation.quantize: CUDA, bf16,
        a fused int8 matmul) where they are now; returns the interface. Once per interface."""
        if mode in (None, "none") or mode == self.quantized:
            return self
        if self.quantized != "none":
            raise ValueError(
                f"quantize={mode!r}: the models are quantized already ({self.quantized}); load the "
                "checkpoint again for another mode"
            )
        for model in self.models:
            quantize_for_generation(model, mode, self.device, keyword=True)
        self.quantized = mode
        self._generators.clear()
        return self

    def _set_model_modes(self) -> None:
        for model in self.models:
            model.train(self.retain_dropout)

    # ---- text <-> ids -----------------------------------------------------------------------------
    def encode(self, sentence: str) -> torch.LongTensor:
        """Ids of `sentence` (tokenizer, then BPE, then the dictionary), ending with </s>, as upstream."""
        return self.binarize(self.codec.encode(sentence))

    def decode(self, tokens: torch.LongTensor) -> str:
        return self.codec.decode(self.string(tokens))

    def tokenize(self, sentence: str) -> str:
        return self.tokenizer.encode(sentence) if self.tokenizer is not None else sentence

    def detokenize(self, sentence: str) -> str:
        return self.tokenizer.decode(sentence) if self.tokenizer is not None else sentence

    def apply_bpe(self, sentence: str) -> str:
        return self.bpe.encode(sentence) if self.bpe is not None else sentence

    def remove_bpe(self, sentence: str) -> str:
        return self.bpe.decode(sentence) if self.bpe is not None else sentence

    def binarize(self, sentence: str) -> torch.LongTensor:
        return self.src_dict.encode_line(sentence, add_if_not_exist=False).long()

    def string(self, tokens: torch.LongTensor) -> str:
        return self.tgt_dict.string(tokens)

    # ---- generation -------------------------------------------------------------------------------
    # beam defaults: GenerationConfig's (upstream's 5), written there only
    def translate(
        self, sentences: List[str], beam: int = GenerationConfig.beam, verbose: bool = False, **kwargs
    ) -> List[str]:
        return self.sample(sentences, beam, verbose, **kwargs)

    def sample(self, sentences: List[str], beam: int = 1, verbose: bool = False, **kwargs) -> List[str]:
        """The best hypothesis of each sentence as text: the prompt followed by its continuation."""
        sentences, single = sentence_list(sentences, "sample")
        tokenized = [self.encode(sentence) for sentence in sentences]
        texts = [self.decode(hypos[0]["tokens"]) for hypos in self.generate(tokenized, beam, verbose, **kwargs)]
        return texts[0] if single else texts

    def score(self, sentences: List[str], replace_newline_with_eos: bool = False, **kwargs):
        """Each sentence scored by the model in one full forward, as upstream: a hypothesis dict whose `tokens` are
        the sentence's ids without its final </s>, `positional_scores` one natural-log probability per token of
        `tokens` given </s> (<s> with --add-bos-token) and the tokens before it, `score` their mean (NaN for an
        empty sentence). So "w1 w2 w3" has 3 scores: the final </s> is not scored, nor the start token. With
        `replace_newline_with_eos` the lines of a sentence are joined by </s>, which is then scored where it
        separates lines (</s> at the very start or end is dropped). docs/generation.md has the details."""
        sentences, single = sentence_list(sentences, "score")

        def encode(sentence):
            if replace_newline_with_eos:
                return torch.cat([self.encode(line) for line in sentence.splitlines()])
            return self.encode(sentence)

        tokenized = [encode(sentence) for sentence in sentences]
        scored = [hypos[0] for hypos in self.generate(tokenized, score_reference=True, **kwargs)]
        return scored[0] if single else scored

    def generate(
        self,
        tokenized_sentences: List[torch.LongTensor],
        beam: int = GenerationConfig.beam,
        verbose: bool = False,
        skip_invalid_size_inputs: bool = False,
        inference_step_args: Optional[Dict[str, Any]] = None,
        prefix_allowed_tokens_fn=None,
        seed: Optional[int] = None,
        **kwargs,
    ) -> List[List[Dict[str, torch.Tensor]]]:
        """Per input (ids from `encode`), its hypotheses, best first: dicts with "tokens" (the prompt and its
        continuation), "score", "positional_scores" (natural log), "attention", "alignment". Keyword
        arguments set generation options (upstream's names: sampling=True, sampling_topk=10, temperature=0.8,
        max_len_b=50, lenpen=..., min_len=...). Inputs longer than the model's positions are an error, or
        skipped (and missing from the result) with `skip_invalid_size_inputs`. `seed` (sampling at beam 1):
        the draws' seed, so that input i gets the same sample whatever the batches; default a new one per
        call from torch's RNG (torch.manual_seed reproduces a sequence of calls). `inference_step_args` may
        hold `on_tokens` to stream (see `stream`). A prompt holds ids of the dictionary other than <pad>;
        anything else is one TypeError or ValueError naming the argument (fairseq.hub.hub_inputs)."""
        prompts, single = prompt_list(tokenized_sentences)
        check_prompt_ids(prompts, len(self.src_dict), self.src_dict.pad(), single)
        check_seed(seed, "generate")
        generator = self.generator_for(beam, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, **kwargs)
        options = None if kwargs.get("score_reference") else self._generation_options(beam, **kwargs)
        if (
            isinstance(generator, SequenceGenerator)
            and isinstance(generator.search, Sampling)
            and device_decoding.applies(generator, generator.beam_size)
        ):
            # counter-based draws: one seed per call, the ids are the inputs' indices (other sampling draws
            # from torch's RNG, which this must then leave as it is)
            generator.search.seed = int(torch.randint(2**31, (1,))) if seed is None else seed
        results = []
        for batch in self._build_batches(prompts, skip_invalid_size_inputs, options):
            batch = move_to(batch, self.device)
            hypos = self.task.inference_step(generator, self.models, batch, **(inference_step_args or {}))
            results.extend(zip(batch["id"].tolist(), hypos))
        outputs = [hypos for _, hypos in sorted(results, key=lambda pair: pair[0])]
        if verbose:
            for source, hypotheses in zip(prompts, outputs):
                logger.info(f"S\t{self.string(source)}")
                for hypo in hypotheses:
                    logger.info(f"H\t{float(hypo['score'])}\t{self.decode(hypo['tokens'])}")
                    logger.info("P\t" + " ".join(f"{x:.4f}" for x in hypo["positional_scores"].tolist()))
        return outputs[0] if single else outputs

    def stream(self, sentence: str, seed: Optional[int] = None, beam: int = 1, **kwargs) -> Iterator[str]:
        """The text of `sample(sentence, beam=1, **kwargs)` in pieces as it is generated (every
        device_decoding.CHUNK tokens): the prompt with the first tokens, then what each chunk adds; joined,
        the pieces are sample()'s text. Greedy, or sampling=True with its options (beam 1 only)."""
        check_stream_beam(beam)
        if not isinstance(sentence, str):
            raise TypeError(f"stream(): sentence must be a string (one prompt), got {type(sentence).__name__}")
        check_seed(seed, "stream")
        produced: "queue.Queue" = queue.Queue()

        def on_tokens(tokens: torch.Tensor, done: torch.Tensor) -> None:
            produced.put(tokens)

        def decode_all() -> None:
            try:
                produced.put(
                    self.generate(
                        self.encode(sentence), beam=1, seed=seed, inference_step_args={"on_tokens": on_tokens}, **kwargs
                    )
                )
            except BaseException as error:  # raised in the caller's thread
                produced.put(error)

        worker = threading.Thread(target=decode_all, name="fairseq-hub-stream", daemon=True)
        worker.start()
        pieces = TextPieces()
        while True:
            item = produced.get()
            if isinstance(item, BaseException):
                worker.join()
                raise item
            if isinstance(item, list):  # the hypotheses: the end
                worker.join()
                piece = pieces.extend(self.decode(item[0]["tokens"]), final=True)
                if piece:
                    yield piece
                return
            piece = pieces.extend(self.decode(first_streamed_hypothesis(item, self.tgt_dict.pad())))
            if piece:
                yield piece

    def generator_for(self, beam: int = GenerationConfig.beam, prefix_allowed_tokens_fn=None, **kwargs):
        """The generator `generate(..., beam=beam, **kwargs)` decodes with: `task.build_generator` of
        cfg.generation with these options set (a SequenceScorer with score_reference=True, as score() asks).
        Built on the first call with these options (all of them, so any option that changes the generator
        gives another one) and `prefix_allowed_tokens_fn`, reused after. The models are quantized first when
        from_pretrained was given `quantize=`."""
        gen_args = self._generation_options(beam, **kwargs)
        self.quantize(self.cfg.generation.quantize)
        key = (repr(sorted(vars(gen_args).items())), prefix_allowed_tokens_fn)
        generator = self._generators.pop(key, None)
        if generator is None:
            generator = self.task.build_generator(
                self.models, gen_args, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn
            )
        elif hasattr(getattr(generator, "model", None), "set_decoder_beam_size"):
            # What building it told the (shared) decoders, which a generator of another beam may have changed.
            generator.model.set_decoder_beam_size(generator.beam_size)
        self._generators[key] = generator
        while len(self._generators) > self.max_cached_generators:
            self._generators.popitem(last=False)
        self._set_model_modes()  # a SequenceGenerator puts its models in eval mode when built
        return generator

    def _generation_options(self, beam: int, **kwargs):
        """cfg.generation with `beam` and the keyword arguments set, checked (one line naming the keyword)."""
        gen_args = copy.deepcopy(self.cfg.generation)
        gen_args.beam = beam
        for key, value in kwargs.items():
            if key == "quantize":
                raise ValueError(
                    f"generate(): quantize={value!r} applies to the models, not to one call: pass it to "
                    f"from_pretrained or call lm.quantize({value!r}) once"
                )
            if not hasattr(gen_args, key):
                raise ValueError(
                    f"generate(): {key}={value!r} is no generation option (options: "
                    f"{', '.join(sorted(vars(gen_args)))})"
                )
            setattr(gen_args, key, value)
        check_unsupported_options(gen_args)
        check_option_values(gen_args, keyword=True)
        # the log-probabilities are float32, or float64 for models cast to it (get_normalized_probs upcasts)
        probabilities = "float64" if self._float_tensor.dtype == torch.float64 else "float32"
        check_sampling_range(
            gen_args.sampling_topk,
            gen_args.sampling_topp,
            gen_args.temperature,
            vocab_size=len(self.tgt_dict),
            keyword=True,
            probability_dtype=probabilities,
        )
        for key in ("sampling_topk", "sampling_topp"):  # build_generator's rule, in the keywords' names
            if getattr(gen_args, key) >= 0 and not gen_args.sampling:
                raise ValueError(
                    f"generate(): {key}={getattr(gen_args, key)!r} needs sampling=True (it restricts "
                    "the tokens sampling draws from); pass sampling=True or drop it"
                )
        return gen_args

    def _build_batches(
        self, tokens: List[torch.Tensor], skip_invalid_size_inputs: bool, options=None
    ) -> Iterator[Dict[str, Any]]:
        """Batches of `tokens`; with generation `options`, the largest one's KV cache is checked against the
        device's memory first (decode_memory.check_decode_memory, CUDA only)."""
        lengths = [t.numel() for t in tokens]
        if not skip_invalid_size_inputs:
            check_prompt_lengths(lengths, self.max_positions, "pass skip_invalid_size_inputs=True to skip it")
        max_tokens, batch_size = self.cfg.dataset.max_tokens, self.cfg.dataset.batch_size
        check_max_tokens(max_tokens, "max_tokens=")  # from_pretrained's keywords (cfg.dataset)
        check_batch_size(batch_size, "batch_size=")
        epoch_itr = self.task.get_batch_iterator(
            dataset=self.task.build_dataset_for_inference(tokens, lengths),
            max_tokens=max_tokens,
            max_sentences=batch_size if (max_tokens or batch_size) else 1,
            max_positions=self.max_positions,
            ignore_invalid_inputs=skip_invalid_size_inputs,
            disable_iterator_cache=True,
        )
        if options is not None and self.device.type == "cuda":
            rows = [
                (
                    len(b),
                    decode_positions(
                        max(lengths[i] for i in b), options.max_len_a, options.max_len_b, self.max_positions
                    ),
                )
                for b in epoch_itr.frozen_batches
                if len(b)
            ]
            if rows:
                sentences, positions = max(rows, key=lambda r: r[0] * r[1])
                check_decode_memory(
                    self.models,
                    sentences,
                    options.beam,
                    positions,
                    self.device,
                    fix="generate fewer sentences per call (or a smaller max_tokens/batch_size "
                    "in from_pretrained), a smaller beam or max_len_b",
                )
        return epoch_itr.next_epoch_itr(shuffle=False)
