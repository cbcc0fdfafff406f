"""GPT-2's byte-level BPE tables, and which merge results the published BPE algorithm can output: what the
tiktoken engine of `gpt2_bpe_utils.Encoder` needs to give the published algorithm's ids (see that module's
docstring: conditions (a), `merge_order_is_safe`, and (b), `producible_tokens`).

Only the standard library: the data-preparation scripts load this file on its own, beside `gpt2_bpe_utils`
(which re-exports its names).
"""

from typing import Dict, Iterable, Sequence, Tuple


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the other 68 bytes
    (controls, space, 0x7F-0xA0, 0xAD) take the characters 256, 257, ... in byte order."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def get_pairs(word: Sequence[str]) -> set:
    """The set of adjacent symbol pairs of a word (upstream's helper of the same name)."""
    return set(zip(word, word[1:]))


# ---- which tokens the published algorithm can produce ---------------------------------------------------------
def merge_order_is_safe(merges: Sequence[Tuple[str, str]]) -> bool:
    """True when every merge using a token ranks after every merge producing it (merges in rank order, without
    repeats). Then the published algorithm applies the merges in rank order, each to all its occurrences, and
    merging one occurrence at a time (lowest rank, leftmost first) gives the same result."""
    used = set()
    for a, b in merges:
        if a + b in used:  # produced after a merge that uses it
            return False
        used.add(a)
        used.add(b)
    return True


def producible_tokens(
    bpe_ranks: Dict[Tuple[str, str], int], merges: Sequence[Tuple[str, str]], alphabet: Iterable[str]
) -> Dict[str, int]:
    """Every merge result that the published algorithm can output, with the rank of the merge producing it,
    for merges (`merges`: in rank order, without repeats; `bpe_ranks`: pair -> rank) whose order is safe
    (`merge_order_is_safe`).

    With a safe order the merges apply in rank order, so the symbols over a span of a piece evolve as the
    span alone would while no merge joins a symbol inside it with one outside. Hence t = a + b (rank r) is
    output for some byte string iff it is for t alone, iff a and b are themselves producible (or bytes) and
    no merge ranked below r joins the symbol that ends a's side with the one that starts b's side while
    both exist (at one rank the leftmost occurrence goes first). Those two symbols run through the
    suffixes and prefixes that a's and b's own encodings build over time, recorded below; the pairs
    current at the same time are walked in time order. A later merge with the same result never applies
    (two adjacent symbols that form t are always the pair that t's own encoding merges last)."""
    get = bpe_ranks.get
    # token -> (symbols, ranks): the last (first) symbol of the token's own encoding, and from which rank on
    suffixes = {c: ((c,), (-1,)) for c in alphabet}
    prefixes = dict(suffixes)
    live: Dict[str, int] = {}
    for a, b in merges:
        t = a + b
        if t in live:
            continue
        left = suffixes.get(a)
        right = prefixes.get(b)
        if left is None or right is None:
            continue
        r = bpe_ranks[a, b]
        ls, lf = left
        rs, rf = right
        nl, nr = len(ls) - 1, len(rs) - 1
        i = j = 0
        while i < nl or j < nr:  # (a, b) themselves, current last, are the merge of rank r
            s_to = lf[i + 1] if i < nl else r
            p_to = rf[j + 1] if j < nr else r
            k = get((ls[i], rs[j]))
            # At a tie (one merge y+y also turning b's first y into a longer prefix, or a's last y into a
            # longer suffix) the leftmost occurrence merges first: across the boundary before b's, after a's.
            if k is not None and lf[i] < k < s_to and rf[j] < k <= p_to:
                break  # crossed: t is never output
            if s_to <= p_to:
                i += 1
            if p_to <= s_to:
                j += 1
        else:
            live[t] = r
            ss, sf = suffixes[b]
            suffixes[t] = (ss + (t,), sf + (r,))
            ps, pf = prefixes[a]
            prefixes[t] = (ps + (t,), pf + (r,))
    return live
