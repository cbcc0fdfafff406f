"""The batch-size options, one check each, shared by every entry point (fairseq-train, -hydra-train, -generate,
-interactive, -eval-lm, -validate, the memory planner) and the hub interface, so a value is refused with the
same line everywhere, before any data or checkpoint is read.

Each check takes the value and the name to report: a flag ("--max-tokens", reported as `--max-tokens -100`) or a
keyword of the hub ("max_tokens=", reported as `max_tokens=-100`); a wrong value or type is a ValueError (the
entry points' usage error). The data layer still reads a limit of 0 or
less as "no limit" (upstream's -1 for library callers); from a command line or the hub it is refused here.
"""

from numbers import Integral
from typing import Optional, Sequence


def _label(name: str, value) -> str:
    return f"{name}{value!r}" if name.endswith("=") else f"{name} {value}"


def _check_count(value, name: str, least: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{_label(name, value)} must be an integer: {meaning}")
    if value < least:
        raise ValueError(f"{_label(name, value)} must be at least {least}: {meaning}")


def check_max_tokens(value: Optional[int], name: str = "--max-tokens") -> None:
    """None (not given) or an integer of at least 1."""
    if value is not None:
        _check_count(
            value, name, 1, "the most tokens in one batch (leave it out to batch by the number of sentences alone)"
        )


def check_batch_size(value: Optional[int], name: str = "--batch-size") -> None:
    """None (not given) or an integer of at least 1."""
    if value is not None:
        _check_count(
            value, name, 1, "the most sentences in one batch (leave it out to batch by the number of tokens alone)"
        )


def check_update_freq(values: Optional[Sequence[int]], name: str = "--update-freq") -> None:
    """None or a non-empty list of integers of at least 1 (the batches accumulated into one update, per epoch;
    the last value holds for the later epochs)."""
    if values is None:
        return
    if isinstance(values, Integral):
        values = [values]
    shown = ",".join(str(v) for v in values)
    if len(values) == 0:
        raise ValueError(f"{name} is empty: give the batches accumulated into one update, e.g. {name} 4")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
            raise ValueError(
                f"{_label(name, shown)}: every value must be an integer of at least 1 (the batches "
                "whose gradients make one update; one value per epoch, e.g. 4 or 4,2)"
            )


def check_buffer_size(value: Optional[int], name: str = "--buffer-size") -> None:
    """None or an integer of at least 0 (0 and 1 both read one input line at a time, as upstream)."""
    if value is not None:
        _check_count(value, name, 0, "the input lines read before generating for them (0 or 1: one at a time)")


def check_batch_flags(cfg, required: bool = False) -> None:
    """The batch options of a FairseqConfig (fairseq-train, -hydra-train, -validate, -eval-lm): --max-tokens,
    --batch-size and their -valid forms, --update-freq. `required`: one of --max-tokens and --batch-size must be
    given (fairseq-train, fairseq-validate; the other tools have a default batch). fairseq-generate and
    -interactive check theirs with their generation options (check_generation_config), the planner and the hub
    call the checks above."""
    dataset = cfg.dataset
    if required and dataset.max_tokens is None and dataset.batch_size is None:
        raise ValueError("give a batch size with --max-tokens or --batch-size")
    check_max_tokens(dataset.max_tokens)
    check_batch_size(dataset.batch_size)
    check_max_tokens(_given(dataset.max_tokens_valid), "--max-tokens-valid")
    check_batch_size(_given(dataset.batch_size_valid), "--batch-size-valid")
    check_update_freq(cfg.optimization.update_freq)


def _given(value):
    """A -valid option still holding its "${dataset.max_tokens}" interpolation was not given (its value is the
    training option's, checked already)."""
    return None if isinstance(value, str) and value.startswith("${") else value
