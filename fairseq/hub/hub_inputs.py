"""What the hub interface's methods accept, checked before anything is encoded or decoded: one TypeError (a wrong
type) or ValueError (a wrong value) naming the method, the argument and what it takes, instead of a raw error
from deep inside, or a prompt silently cut at a padding id. Used by fairseq.hub.hub_utils (fairseq-interactive
checks its prompts' lengths here too).
"""

import bisect
import itertools
from numbers import Integral
from typing import List, Optional, Sequence, Tuple

import torch


def sentence_list(sentences, method: str) -> Tuple[List[str], bool]:
    """(`sentences` as a list of strings, whether one string was given): sample(), translate(), score() and
    stream() take a string or a list (or tuple) of strings."""
    if isinstance(sentences, str):
        return [sentences], True
    if not isinstance(sentences, (list, tuple)):
        raise TypeError(f"{method}(): sentences must be a string or a list of strings, got {_describe(sentences)}")
    for i, sentence in enumerate(sentences):
        if not isinstance(sentence, str):
            raise TypeError(f"{method}(): sentences[{i}] is {_describe(sentence)}, not a string")
    return list(sentences), False


def prompt_list(prompts) -> Tuple[List[torch.Tensor], bool]:
    """(generate()'s `tokenized_sentences` as a list of 1-D id tensors, whether one tensor was given): a 1-D
    tensor of ids (one prompt), a 2-D one (a prompt per row), or a list (or tuple) of 1-D tensors, as encode()
    gives them. Integer ids only."""
    name = "tokenized_sentences"
    if torch.is_tensor(prompts) and prompts.dim() in (1, 2):
        single = prompts.dim() == 1
        prompts = [prompts] if single else list(prompts)
    elif isinstance(prompts, (list, tuple)):
        single = False
        for i, prompt in enumerate(prompts):
            if not (torch.is_tensor(prompt) and prompt.dim() == 1):
                what = f"a {prompt.dim()}-D tensor" if torch.is_tensor(prompt) else _describe(prompt)
                raise TypeError(
                    f"generate(): {name}[{i}] is {what}; each prompt is a 1-D tensor of ids (encode() "
                    "gives one; encode() a string first)"
                )
    else:
        what = f"a {prompts.dim()}-D tensor" if torch.is_tensor(prompts) else _describe(prompts)
        raise TypeError(
            f"generate(): {name} must be a 1-D tensor of ids or a list of them (encode() gives one per "
            f"sentence; sample() takes text), got {what}"
        )
    for i, prompt in enumerate(prompts):
        if prompt.dtype == torch.bool or prompt.is_floating_point() or prompt.is_complex():
            where = "" if single else f"[{i}]"
            raise TypeError(
                f"generate(): {name}{where} holds {prompt.dtype} values; ids are integers (a "
                "LongTensor, as encode() gives)"
            )
    return [prompt.long() for prompt in prompts], single


def check_prompt_ids(prompts: Sequence[torch.Tensor], vocab_size: int, pad: int, single: bool) -> None:
    """ValueError for the first prompt with an id outside the dictionary (0 .. vocab_size - 1) or the padding id
    (batches are padded for the caller; a <pad> inside a prompt would cut it there). One pass over all ids."""
    lengths = [p.numel() for p in prompts]
    if not sum(lengths):
        return
    ids = torch.cat([p.reshape(-1).long() for p in prompts])
    bad = (ids < 0) | (ids >= vocab_size) | (ids == pad)
    if not bool(bad.any()):
        return
    first = int(bad.nonzero()[0])
    ends = list(itertools.accumulate(lengths))
    row = bisect.bisect_right(ends, first)
    position = first - (ends[row - 1] if row else 0)
    value = int(ids[first])
    where = f"tokenized_sentences{'' if single else f'[{row}]'}"
    if value == pad:
        raise ValueError(
            f"generate(): {where} holds the padding id {pad} at position {position}: a prompt cannot "
            "hold <pad> (batches are padded for you); remove it"
        )
    raise ValueError(
        f"generate(): {where} holds id {value} at position {position}, outside this model's "
        f"dictionary (ids 0 to {vocab_size - 1}); encode() gives ids of this dictionary"
    )


def check_prompt_lengths(lengths: List[int], max_positions: Optional[int], skip_hint: str, first_id: int = 0) -> None:
    """ValueError for the first prompt longer than the model's positions. `lengths` count the prompt's
    tokens plus the </s> (or <s>) that generation starts from."""
    if max_positions is None:
        return
    for i, n in enumerate(lengths):
        if n > max_positions:
            raise ValueError(
                f"prompt {first_id + i} is {n} tokens long (with the </s> it starts from), more than the model's "
                f"{max_positions} positions (the --tokens-per-sample / --max-target-positions it was trained "
                f"with); shorten the prompt, or {skip_hint}"
            )


def check_seed(seed: Optional[int], method: str) -> None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, Integral)):
        raise TypeError(
            f"{method}(): seed={seed!r} must be an integer (the sampling draws' seed) or None (a new one per call)"
        )


def check_stream_beam(beam) -> None:
    """stream() decodes one hypothesis as it grows: beam 1 (greedy, or sampling=True), as fairseq-interactive
    --stream, whose line this is in the keywords' names."""
    if beam != 1:
        raise ValueError(
            f"stream(): beam={beam!r}: streaming needs beam=1 (greedy, or sampling=True); use "
            "sample() or generate() for a beam search"
        )


def _describe(value) -> str:
    """None, a number, or 'a TYPE (its repr, shortened)'."""
    text = repr(value)
    if value is None or isinstance(value, (bool, int, float)):
        return text
    return f"a {type(value).__name__} ({text if len(text) <= 40 else text[:37] + '...'})"
