"""fairseq-interactive: continue prompts read from standard input (or --input) with a trained language model.

    echo "the cat sat" | fairseq-interactive data-bin --task language_modeling \
        --path checkpoints/checkpoint_best.pt --beam 1 --max-len-b 64

Prompts are read --buffer-size lines at a time (each line stripped), encoded with --tokenizer/--bpe and the
dictionary, batched (--batch-size/--max-tokens, default one prompt per batch) and generated from. Per prompt,
in input order, upstream's lines: `S-{id}\\t{prompt tokens}`, `W-{id}\\t{seconds}\\tseconds`, then per hypothesis
`H-`, `D-`, `P-` as fairseq-generate writes them (scores in base 2). An empty line is refused (one error line
naming it; upstream would sample from </s> alone, which is rarely what a blank line meant).
"""

import argparse
import logging
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, List, Optional

import numpy as np

import torch

from fairseq.frontend import options
from fairseq.dataclass.generation import check_generation_config
from fairseq.hub.hub_inputs import check_prompt_lengths
from fairseq.hub.text import TextPieces, first_streamed_hypothesis, move_to
from fairseq_cli.console import run_console_script
from fairseq_cli.generate import (
    check_batches_fit,
    load_ensemble,
    max_positions_of,
    print_hypotheses,
    setup,
    symbols_to_strip,
)

logger = logging.getLogger("fairseq_cli.interactive")

SKIP_HINT = "pass --skip-invalid-size-inputs-valid-test to skip such prompts"


@contextmanager
def _open_input(path: str):
    if path == "-":
        yield sys.stdin
        return
    try:
        handle = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"--input {path}: no such file (pass '-' to read standard input)") from None
    except IsADirectoryError:
        raise ValueError(
            f"--input {path} is a directory: pass a text file, one prompt a line, or '-' to read standard input"
        ) from None
    except OSError as err:
        raise ValueError(
            f"--input {path}: cannot read it: {err.strerror or err}; pass a readable text file or "
            "'-' to read standard input"
        ) from None
    with handle:
        yield handle


# Python's universal newlines: a line ends at \r\n, \r or \n (standard input splits at \n alone).
_LINE_END = re.compile(r"\r\n|\r|\n")


def universal_lines(chunks: Iterable[str]) -> Iterator[str]:
    """The lines of text read in `chunks` (a file's or standard input's lines, which end at a \n or at the
    end), each without its line end, \r\n, \r and \n all ending a line."""
    for chunk in chunks:
        lines = _LINE_END.split(chunk)
        yield from lines[:-1] if lines[-1] == "" else lines


def buffered_read(path: str, buffer_size: int) -> Iterator[List[str]]:
    """Lists of up to `buffer_size` stripped lines of file `path` ('-': standard input); \r\n, \r and \n
    each end a line, as Python's universal newlines."""
    buffer = []
    with _open_input(path) as lines:
        for line in universal_lines(lines):
            buffer.append(line.strip())
            if len(buffer) >= buffer_size:
                yield buffer
                buffer = []
    if buffer:
        yield buffer


def make_batches(
    lines: List[str],
    cfg,
    task,
    max_positions: Optional[int],
    codec,
    first_id: int,
    check_fit: Optional[Callable] = None,
):
    """(batches of the encoded `lines`, the index in `lines` of each batch id): upstream's make_batches. Too
    long prompts are an error, or with --skip-invalid-size-inputs-valid-test left out with a warning naming
    them by their number in the input. `check_fit(batches, widths)` sees the batches before any is decoded.
    --stream: one prompt per batch."""
    for i, line in enumerate(lines):
        if not line:
            raise ValueError(
                f"prompt {first_id + i} is an empty line; give each prompt some text (blank lines "
                "are not prompts: remove them from the input)"
            )
    tokens = [task.source_dictionary.encode_line(codec.encode(line), add_if_not_exist=False).long() for line in lines]
    lengths = [t.numel() for t in tokens]
    if not cfg.dataset.skip_invalid_size_inputs_valid_test:
        check_prompt_lengths(lengths, max_positions, SKIP_HINT, first_id=first_id)
    kept = [i for i, n in enumerate(lengths) if max_positions is None or n <= max_positions]
    batch_size, max_tokens = cfg.dataset.batch_size, cfg.dataset.max_tokens
    if cfg.generation.stream:
        batch_size, max_tokens = 1, None
    elif max_tokens is None and batch_size is None:
        batch_size = 1  # upstream's default: one prompt per batch
    for i in sorted(set(range(len(lines))) - set(kept)):  # named here: the task's warning counts within `lines`
        logger.warning(
            f"prompt {first_id + i} is {lengths[i]} tokens long (with the </s> it starts from), more "
            f"than the model's {max_positions} positions: skipped (--skip-invalid-size-inputs-valid-test)"
        )
    epoch_itr = task.get_batch_iterator(
        dataset=task.build_dataset_for_inference([tokens[i] for i in kept], [lengths[i] for i in kept]),
        max_tokens=max_tokens,
        max_sentences=batch_size,
        max_positions=max_positions,
        ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
        disable_iterator_cache=True,
    )
    if check_fit is not None:
        check_fit(epoch_itr.frozen_batches, np.asarray([lengths[i] for i in kept], dtype=np.int64))
    return epoch_itr.next_epoch_itr(shuffle=False), kept


class StreamPrinter:
    """--stream: prints the text of a prompt's hypothesis (the --text-only line) as its tokens arrive."""

    def __init__(self, tgt_dict, post_process, codec, strip):
        self.tgt_dict, self.post_process, self.codec, self.strip = tgt_dict, post_process, codec, strip
        self.pieces = TextPieces()

    def _text(self, tokens: torch.Tensor) -> str:
        return self.codec.decode(self.tgt_dict.string(tokens, self.post_process, extra_symbols_to_ignore=self.strip))

    def __call__(self, tokens: torch.Tensor, done: torch.Tensor) -> None:
        piece = self.pieces.extend(self._text(first_streamed_hypothesis(tokens, self.tgt_dict.pad())))
        if piece:
            print(piece, end="", flush=True)

    def finish(self, hypo: dict) -> None:
        print(self.pieces.extend(self._text(hypo["tokens"].int().cpu()), final=True), flush=True)


@dataclass
class _Loaded:
    """What decoding the prompts needs, loaded once: the ensemble, its task and device, the text codec, the
    generator and the symbols its lines leave out."""

    cfg: Any
    models: list
    task: Any
    device: torch.device
    codec: Any
    generator: Any
    strip: Any


def main(cfg) -> int:
    """Generate for every prompt of --input; returns the number of prompts read. `cfg` is the config of
    convert_namespace_to_generation_config or, as upstream accepts, the namespace of parse_args_and_arch (of
    upstream's generation parser too, with --buffer-size / --input set on it as upstream's tests do)."""
    if isinstance(cfg, argparse.Namespace):
        cfg = options.convert_namespace_to_generation_config(cfg)
        check_generation_config(cfg.generation, cfg.dataset, cfg.interactive)
    start_time = time.perf_counter()
    buffer_size = max(cfg.interactive.buffer_size, 1)
    setup(cfg, cfg.interactive)
    models, task, device, codec = load_ensemble(cfg)
    generator = task.build_generator(models, cfg.generation)
    loaded = _Loaded(cfg, models, task, device, codec, generator, symbols_to_strip(generator, task.target_dictionary))
    max_positions = max_positions_of(task, models)

    def check_fit(batches, widths):
        check_batches_fit(cfg, models, batches, widths, max_positions, device)

    if buffer_size > 1:
        logger.info(f"Sentence buffer size: {buffer_size}")
    logger.info("NOTE: hypothesis and token scores are output in base 2")
    if cfg.interactive.input == "-" and sys.stdin.isatty():  # a prompt for a person, not for a pipe
        logger.info("Type the input sentence and press return:")
    start_id, generate_time = 0, 0.0
    for lines in buffered_read(cfg.interactive.input, buffer_size):
        batches, kept = make_batches(lines, cfg, task, max_positions, codec, start_id, check_fit)
        results, seconds = _generate(loaded, batches, kept, start_id)
        generate_time += seconds
        _print_results(loaded, results)
        sys.stdout.flush()
        start_id += len(lines)
    logger.info(f"Total time: {time.perf_counter() - start_time:.3f} seconds; translation time: {generate_time:.3f}")
    return start_id


def _generate(loaded: _Loaded, batches, kept: List[int], start_id: int):
    """([(prompt number, prompt tokens, hypotheses, seconds per prompt)], seconds generating) for one buffer's
    batches; --stream prints each prompt's text as it comes instead (and returns no results)."""
    cfg, task, tgt_dict = loaded.cfg, loaded.task, loaded.task.target_dictionary
    results, generate_time = [], 0.0
    if cfg.generation.stream:  # one prompt per batch, printed as it comes: in input order
        batches = sorted(batches, key=lambda batch: int(batch["id"][0]))
    for batch in batches:
        batch = move_to(batch, loaded.device)
        # Sampling draws are keyed by the prompt's number in the whole input (device_decoding).
        numbered = dict(batch, id=torch.tensor([start_id + kept[i] for i in batch["id"].tolist()]))
        on_tokens = (
            StreamPrinter(tgt_dict, cfg.common_eval.post_process, loaded.codec, loaded.strip)
            if cfg.generation.stream
            else None
        )
        started = time.perf_counter()
        hypos = task.inference_step(loaded.generator, loaded.models, numbered, on_tokens=on_tokens)
        seconds = time.perf_counter() - started  # --stream: printing the pieces included
        generate_time += seconds
        if on_tokens is not None:
            on_tokens.finish(hypos[0][0])
            continue
        for i, (sample_id, sample_hypos) in enumerate(zip(batch["id"].tolist(), hypos)):
            src_tokens = batch["net_input"]["src_tokens"][i]
            results.append(
                (
                    start_id + kept[sample_id],
                    src_tokens[src_tokens.ne(tgt_dict.pad())],
                    sample_hypos,
                    seconds / len(hypos),
                )
            )
    return results, generate_time


def _print_results(loaded: _Loaded, results) -> None:
    """Each prompt's lines, in input order: S- and W- unless --text-only, then its hypotheses'."""
    cfg, post_process = loaded.cfg, loaded.cfg.common_eval.post_process
    src_dict, tgt_dict = loaded.task.source_dictionary, loaded.task.target_dictionary
    for sample_id, src_tokens, sample_hypos, seconds in sorted(results, key=lambda r: r[0]):
        if not cfg.generation.text_only:
            print(f"S-{sample_id}\t{src_dict.string(src_tokens, post_process)}")
            print(f"W-{sample_id}\t{seconds:.3f}\tseconds")
        print_hypotheses(
            sample_id,
            sample_hypos,
            cfg.generation.nbest,
            tgt_dict,
            post_process,
            loaded.codec,
            loaded.strip,
            sys.stdout,
            cfg.generation.text_only,
        )


def cli_main(argv: Optional[List[str]] = None) -> None:
    parser = options.get_interactive_generation_parser()
    args = options.parse_args_and_arch(parser, argv)
    cfg = options.convert_namespace_to_generation_config(args)
    try:
        check_generation_config(cfg.generation, cfg.dataset, cfg.interactive)
    except ValueError as e:
        parser.error(str(e))
    main(cfg)


def console_main() -> None:
    run_console_script("fairseq-interactive", cli_main)


if __name__ == "__main__":
    console_main()
