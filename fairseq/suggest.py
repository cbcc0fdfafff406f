"""'did you mean' hints: the one implementation behind the suggestions for unknown flags and choices
(fairseq.options), unknown YAML keys (fairseq.frontend.hydra), unknown component names (fairseq.registry)
and unknown --optimizer-overrides keys (fairseq.optim)."""

import difflib
from typing import Callable, Iterable, List, Optional


def close_match(word, candidates: Iterable) -> Optional[str]:
    """The candidate most like `word` (difflib's ratio, at least 0.6), or None."""
    matches = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1)
    return matches[0] if matches else None


def did_you_mean(word, candidates: Iterable, shown: Optional[Callable[[str], str]] = None) -> str:
    """ " (did you mean 'X'?)" for the closest candidate X, or "" when none is close; `shown` writes X
    (default: quoted)."""
    match = close_match(word, candidates)
    if match is None:
        return ""
    return f" (did you mean {shown(match) if shown else repr(match)}?)"


def close_flag(flag: str, option_strings: Iterable[str]) -> Optional[str]:
    """The real flag most like `flag` (`--name` or `--name=value`), compared without the leading dashes (which
    every flag shares, so they would make unrelated flags look alike); None when none is close."""
    by_name = {s.lstrip("-"): s for s in option_strings if s.startswith("--")}
    match = close_match(flag.split("=", 1)[0].lstrip("-"), by_name)
    return by_name[match] if match is not None else None


def closest_first(word, candidates: Iterable) -> List[str]:
    """All the candidates, the most like `word` first (difflib's ratio; ties in their given order): for a list
    that leads with what was probably meant even when nothing is close enough for `did_you_mean`."""
    names = [str(c) for c in candidates]
    return sorted(names, key=lambda c: -difflib.SequenceMatcher(None, str(word), c).ratio())
