"""fairseq.data.encoders: GPT-2 BPE ids equal a pure-Python reference of the published algorithm, the other
schemes behave as upstream's, the registry builds them from names, namespaces, dicts and dataclasses, and
bad files fail with one clear error. No network: the BPE vocabulary and the sentencepiece model are
trained here on the text behind the quickstart's sample corpus (pydoc_data.topics)."""

import argparse
import json
import logging
import sys
import types
import unicodedata

import pytest

regex = pytest.importorskip("regex")  # the reference needs \p{L} / \p{N} (dev extra)
tokenizers = pytest.importorskip("tokenizers")

from fairseq.data.encoders import BPE_REGISTRY, TOKENIZER_REGISTRY, build_bpe, build_tokenizer  # noqa: E402
from fairseq.data.encoders import gpt2_bpe_utils  # noqa: E402
from fairseq.data.encoders.gpt2_bpe import GPT2BPE, GPT2BPEConfig  # noqa: E402

from tests.text_fixtures import sample_text, train_byte_level_bpe, train_spm_model, write_gpt2_files  # noqa: E402


# ---- a pure-Python reference of GPT-2's published BPE --------------------------------------------------------
REF_PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def ref_byte_chars():
    """Printable Latin-1 bytes map to themselves, the rest to chr(256), chr(257), ... in byte order."""
    out, nxt = {}, 256
    for b in range(256):
        if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255:
            out[b] = chr(b)
        else:
            out[b] = chr(nxt)
            nxt += 1
    return out


class ReferenceGPT2:
    """Straightforward version of the algorithm: regex pieces -> byte characters -> repeatedly merge every
    occurrence of the lowest-ranked adjacent pair -> ids from encoder.json (KeyError when missing)."""

    def __init__(self, encoder_path, vocab_path, use_cache=True):
        with open(encoder_path, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(vocab_path, encoding="utf-8") as f:
            merge_lines = f.read().split("\n")[1:-1]
        self.ranks = {}
        for rank, line in enumerate(merge_lines):
            self.ranks[tuple(line.split())] = rank
        self.chars = ref_byte_chars()
        self.cache = {} if use_cache else None

    def merge(self, token):
        if self.cache is not None and token in self.cache:
            return self.cache[token]
        symbols = list(token)
        while len(symbols) > 1:
            pairs = {(symbols[i], symbols[i + 1]) for i in range(len(symbols) - 1)}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i < len(symbols) - 1 and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        if self.cache is not None:
            self.cache[token] = symbols
        return symbols

    def encode(self, text):
        ids = []
        for piece in REF_PATTERN.findall(text):
            token = "".join(self.chars[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[s] for s in self.merge(token))
        return ids


# ---- fixtures -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    # The tricky strings join the training text so that merges of multi-byte characters exist too.
    vocab, merges = train_byte_level_bpe(sample_text() + "\n\n" + "\n\n".join(TRICKY * 20), 2500)
    return write_gpt2_files(tmp_path_factory.mktemp("gpt2_bpe"), vocab, merges)


@pytest.fixture(scope="module")
def fast(gpt2_files):
    return gpt2_bpe_utils.get_encoder(*gpt2_files)


@pytest.fixture(scope="module")
def ref(gpt2_files):
    return ReferenceGPT2(*gpt2_files)


TRICKY = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\n\n\n",
    " \n",
    "\n ",
    "  \n  x",
    "x  ",
    "x \n",
    "a\n\nb",
    "Hello world",
    "Hello  world  ",
    "   leading spaces",
    "trailing spaces   ",
    "\t\ttabbed\tvalue\t",
    "line one\nline two\n",
    "\r\n\r\n",
    "a\rb",
    "\x0b\x0c\x1c\x1d\x1e\x1f",
    "\x00\x01\x7f",
    "\u2028\u2029\x85",
    "no\u00a0break\u00a0space",
    "ideographic\u3000space",
    "en\u2002em\u2003thin\u2009",
    "don't I'll we've you're she'd he's I'm",
    "DON'T I'M 'S 'll",
    "it’s curly’s",
    "''s 'sss ' s '",
    "12345 1,000.50 3.14e-10 007",
    "x²+y³ ½ ¾ Ⅻ ⅷ ٣٤ १२ 𝟘𝟙",
    "v1.2.3-rc4",
    "100%!!! ??? ... --- ***",
    "naïve café résumé façade",
    "e\u0301 combining acute",
    "Ελληνικά Русский עברית العربية हिन्दी ไทย",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "𝐀𝐁𝐂 𒀀𒀁 astral letters",
    "😀 👍🏽 👨‍👩‍👧 🇫🇷 ❤️",
    "emoji😀inside",
    "<|endoftext|>",
    "<s> </s> <unk> <pad>",
    "def f(x):\n    return x  # comment\n",
    '<p class="x">&amp;</p>',
    "https://example.com/a?b=c&d=e#f",
    "a" * 300,
    " " * 100 + "x",
    "word\t \t word",
    "ſ ﬁ ﬂ ligatures",
    "\ufeffBOM",
    "\U0010fffd private",
    "\ue000 pua",
]


# ---- GPT-2: ids -------------------------------------------------------------------------------------------
def test_trained_vocabulary_takes_the_tiktoken_path(fast, gpt2_files):
    assert fast.engine == "tiktoken" and fast._rank_to_id is None  # encoder.json's ids are tiktoken's ranks
    merges = sorted(fast.bpe_ranks, key=fast.bpe_ranks.get)
    assert len(gpt2_bpe_utils.producible_tokens(fast.bpe_ranks, merges, fast.byte_encoder.values())) == len(merges)


@pytest.mark.parametrize("text", TRICKY)
def test_gpt2_ids_equal_the_reference_on_tricky_text(fast, ref, text):
    assert fast.encode(text) == ref.encode(text)
    assert fast.decode(fast.encode(text)) == text


def test_gpt2_ids_equal_the_reference_on_the_sample_corpus(fast, ref):
    text = sample_text()
    lines = text.split("\n")
    assert fast.encode_batch(lines) == [ref.encode(line) for line in lines]
    assert fast.encode(text) == ref.encode(text)  # one long string: newlines and indentation runs inside


def test_gpt2_ids_equal_the_reference_on_random_strings(fast, ref):
    import random

    rng = random.Random(0)
    pool = list("aZé日😀1٣ \t\n\r'-.,!") + ["'s", "'ll", " the", "  ", "\u3000", "\u00a0", "e\u0301", "\U0001d400"]
    texts = ["".join(rng.choice(pool) for _ in range(rng.randint(0, 40))) for _ in range(2000)]
    assert fast.encode_batch(texts) == [ref.encode(t) for t in texts]


def test_gpt2_results_do_not_depend_on_the_cache_or_the_batch(gpt2_files, fast):
    texts = TRICKY + sample_text().split("\n")[:300]
    first = [fast.encode(t) for t in texts]
    assert fast.encode_batch(list(reversed(texts))) == list(reversed(first))
    fresh = gpt2_bpe_utils.get_encoder(*gpt2_files)
    assert fresh.encode_batch(texts) == first
    uncached = ReferenceGPT2(*gpt2_files, use_cache=False)
    assert [uncached.encode(t) for t in TRICKY] == first[: len(TRICKY)]


def code_point_probe_texts():
    """Every assigned code point of Python's Unicode database (every 61st of the big letter and private-use
    ranges) in contexts where its class (letter, number, space, other) decides the split, in blocks."""
    cps = [
        cp
        for cp in range(0x110000)
        if unicodedata.category(chr(cp)) not in ("Cn", "Cs")
        and (unicodedata.category(chr(cp)) not in ("Lo", "Co") or cp % 61 == 0)
    ]
    for i in range(0, len(cps), 4000):
        block = cps[i : i + 4000]
        text = "".join(f"a{c}\n1{c}\n {c}\n{c}a\n{c} \n {c}{c}1\n'{c}s\n{c}  x\n" for c in map(chr, block))
        yield f"code points {hex(block[0])}..{hex(block[-1])}", text


def test_pretokenization_matches_the_regex_on_every_kind_of_code_point(fast):
    """tiktoken's split (through a probe table: every reference piece and every concatenation of two
    neighbouring pieces is one token, so its output is the reference pieces exactly when it cuts the text
    where the reference does) and the tokenizers pre-tokenizer of the fallback engines."""
    import tiktoken

    if tuple(map(int, unicodedata.unidata_version.split("."))) > (15, 1):
        pytest.skip("Python's Unicode database is newer than the Rust regex engines' (15.1)")
    chars = ref_byte_chars()
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for where, s in code_point_probe_texts():
        pieces = REF_PATTERN.findall(s)
        got = [p for p, _ in byte_level.pre_tokenize_str(s)]
        assert got == ["".join(chars[b] for b in p.encode("utf-8")) for p in pieces], where
        ranks = {bytes([b]): b for b in range(256)}
        for p in pieces + [x + y for x, y in zip(pieces, pieces[1:])]:
            ranks.setdefault(p.encode("utf-8"), len(ranks))
        probe = tiktoken.Encoding(
            "probe", pat_str=gpt2_bpe_utils.TIKTOKEN_PATTERN, mergeable_ranks=ranks, special_tokens={}
        )
        assert probe.decode_tokens_bytes(probe.encode_ordinary(s)) == [p.encode("utf-8") for p in pieces], where


def test_tiktoken_pattern_is_the_gpt2_pattern(fast):
    """The rewritten pattern matches what GPT-2's matches (checked with the `regex` module, upstream's engine)."""
    import random

    fast_pattern = regex.compile(gpt2_bpe_utils.TIKTOKEN_PATTERN)
    assert regex.compile(gpt2_bpe_utils.PRETOKENIZE_PATTERN).pattern == REF_PATTERN.pattern
    for where, s in code_point_probe_texts():
        assert fast_pattern.findall(s) == REF_PATTERN.findall(s), where
    rng = random.Random(1)
    pool = list("aZ1' \t\n.-") + ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'x", "\u3000", "\xa0", "\x1c"]
    for _ in range(3000):
        s = "".join(rng.choice(pool) for _ in range(rng.randint(0, 30)))
        assert fast_pattern.findall(s) == REF_PATTERN.findall(s), repr(s)


def test_rust_regex_whitespace_is_python_whitespace():
    """`Encoder.encode_lines` joins stripped lines with "\\n": that is exact only if no character outside
    `str.isspace` is whitespace (\\s) for tiktoken's regex. A whitespace character c makes "c\\n" one piece in
    "ac\\ncb" (a probe table has that piece as one token); the check covers every code point of the
    separator, control, format and unassigned categories, where whitespace lives."""
    import tiktoken

    candidates = [
        cp
        for cp in range(0x110000)
        if not (0xD800 <= cp < 0xE000)
        and not chr(cp).isspace()
        and unicodedata.category(chr(cp))[0] in "ZC"
        and (unicodedata.category(chr(cp)) != "Co" and cp < 0x30000 or cp % 61 == 0)
    ]
    assert len(candidates) > 10000
    ranks = {bytes([b]): b for b in range(256)}
    for cp in candidates:
        ranks[(chr(cp) + "\n").encode("utf-8")] = len(ranks)
    probe = tiktoken.Encoding(
        "probe", pat_str=gpt2_bpe_utils.TIKTOKEN_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    text = "".join(f"a{chr(cp)}\n{chr(cp)}b" for cp in candidates)
    assert [t for t in probe.encode_ordinary(text) if t >= 256] == []
    control = tiktoken.Encoding(
        "control",
        pat_str=gpt2_bpe_utils.TIKTOKEN_PATTERN,
        mergeable_ranks={**{bytes([b]): b for b in range(256)}, b"\x0b\n": 256},
        special_tokens={},
    )
    assert 256 in control.encode_ordinary("a\x0b\n\x0bb")  # (the probe does see whitespace)
    whitespace = regex.compile(r"\s")  # compiled once: the module-level call costs ~8 us of cache lookup each
    assert all(c.isspace() for c in map(chr, range(0x110000)) if whitespace.match(c))  # and for upstream's


def test_merge_order_that_the_rust_bpe_would_get_wrong_uses_the_python_loop(tmp_path, caplog):
    # "ab a" ranks before "a b", which produces "ab": merging one pair at a time would turn "abab" into
    # "aba b"; the published algorithm merges both "a b" first and ends with "abab".
    chars = ref_byte_chars()
    vocab = {c: i for i, c in enumerate(chars.values())}
    for tok in ("ab", "aba", "abab"):
        vocab[tok] = len(vocab)
    enc, bpe = write_gpt2_files(tmp_path, vocab, [("ab", "a"), ("a", "b"), ("ab", "ab")], extra_tokens=())
    with caplog.at_level(logging.WARNING):
        e = gpt2_bpe_utils.get_encoder(enc, bpe)
    assert e.engine == "python" and "Python BPE loop" in caplog.text
    r = ReferenceGPT2(enc, bpe)
    for text in ["abab", "ababa", "aab abab ba", "", "x abab\n\n"]:
        assert e.encode(text) == r.encode(text)
    assert e.encode("abab") == [vocab["abab"]]


def byte_vocab():
    chars = ref_byte_chars()
    return chars, {c: i for i, c in enumerate(chars.values())}


def test_merge_results_that_no_text_produces_are_left_out_of_tiktokens_table(tmp_path):
    # "b c" ranks first, so "abc" alone becomes "a bc" and the merge "ab c" never applies: tiktoken, which
    # merges any pair whose concatenation is in its table, would make "abc" one token if it were there.
    # "x y" then "xy z" then "x yz" (after "y z"): two merges with the result "xyz"; only the first applies.
    _, vocab = byte_vocab()
    merges = [("b", "c"), ("a", "b"), ("ab", "c"), ("x", "y"), ("y", "z"), ("xy", "z"), ("x", "yz"), ("q", "abc")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    enc, bpe = write_gpt2_files(tmp_path, vocab, merges, extra_tokens=())
    e, r = gpt2_bpe_utils.get_encoder(enc, bpe), ReferenceGPT2(enc, bpe)
    assert e.engine == "tiktoken"
    live = gpt2_bpe_utils.producible_tokens(e.bpe_ranks, merges, e.byte_encoder.values())
    assert live == {"bc": 0, "ab": 1, "xy": 3, "yz": 4, "xyz": 5}
    assert e.encode("abc") == [vocab["a"], vocab["bc"]] == r.encode("abc")
    import random

    rng = random.Random(0)
    texts = ["".join(rng.choice("abcqxyz ") for _ in range(rng.randint(0, 20))) for _ in range(3000)]
    assert e.encode_batch(texts) == [r.encode(t) for t in texts]


def random_vocabulary(rng, n_merges, letters="abcde"):
    """A random BPE over a few letters: merges of existing tokens in random order (repeats and results made
    twice included), so the merge order is sometimes unsafe and some merges can never apply."""
    chars, vocab = byte_vocab()
    tokens = list(letters)
    merges = []
    for _ in range(n_merges):
        a, b = rng.choice(tokens), rng.choice(tokens)
        if len(a + b) > 6:
            continue
        merges.append((a, b))
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            tokens.append(a + b)
    return vocab, merges


def test_random_vocabularies_give_the_reference_ids_with_every_engine(tmp_path):
    import random

    rng = random.Random(0)
    engines = set()
    for trial in range(60):
        vocab, merges = random_vocabulary(rng, rng.randint(1, 40))
        if trial % 3 == 0:  # ids out of merge order: tiktoken's ranks are then mapped to them
            ids = list(vocab.values())
            rng.shuffle(ids)
            vocab = dict(zip(vocab, ids))
        d = tmp_path / str(trial)
        d.mkdir()
        enc, bpe = write_gpt2_files(d, vocab, merges, extra_tokens=())
        e, r = gpt2_bpe_utils.get_encoder(enc, bpe), ReferenceGPT2(enc, bpe)
        engines.add(e.engine)
        texts = ["".join(rng.choice("abcde  x") for _ in range(rng.randint(0, 25))) for _ in range(300)]
        assert e.encode_batch(texts) == [r.encode(t) for t in texts], (trial, e.engine, merges)
        lines = [t.strip() for t in texts]
        assert e.encode_lines(lines) == "".join(" ".join(map(str, r.encode(t))) + "\n" for t in lines).encode()
    assert engines == {"tiktoken", "python"}


def test_producible_tokens_are_those_whose_own_encoding_is_themselves():
    """`producible_tokens` against the published algorithm run on each merge result alone (the reference's
    loop), on random safe vocabularies over few letters, where repeated symbols make ties common."""
    import random

    rng = random.Random(2)
    checked = 0
    for _ in range(400):
        vocab, merges = random_vocabulary(rng, rng.randint(1, 40), letters=rng.choice(["ab", "abc"]))
        ranks = dict(zip(merges, range(len(merges))))
        ordered = sorted(ranks, key=ranks.get)
        if not gpt2_bpe_utils.merge_order_is_safe(ordered):
            continue
        live = gpt2_bpe_utils.producible_tokens(ranks, ordered, ref_byte_chars().values())
        ref = ReferenceGPT2.__new__(ReferenceGPT2)
        ref.ranks, ref.cache = ranks, None
        first_rank = {}
        for pair in ordered:
            first_rank.setdefault(pair[0] + pair[1], ranks[pair])
        want = {t: r for t, r in first_rank.items() if ref.merge(t) == [t]}
        assert set(live) == set(want), ordered
        checked += len(ordered)
    assert checked > 1000


def test_encode_lines_is_the_ids_of_each_line(fast, ref):
    import random

    rng = random.Random(3)
    pool = list("aZé日😀1٣ \t'-.,!") + ["'s", "  ", "   ", "\u3000", "\u00a0", "e\u0301", "\x0b", "\x1c", " the"]
    lines = [t.strip() for t in TRICKY if "\n" not in t.strip() and "\r" not in t.strip()]
    lines += ["".join(rng.choice(pool) for _ in range(rng.randint(0, 30))).strip() for _ in range(3000)]
    lines += sample_text().replace("\r", "").split("\n")[:2000]
    lines = [line.strip() for line in lines]
    want = "".join(" ".join(map(str, ref.encode(line))) + "\n" for line in lines).encode()
    assert fast.encode_lines(lines) == want
    kept = [line for line in lines if line]
    assert fast.encode_lines(kept) == "".join(" ".join(map(str, ref.encode(line))) + "\n" for line in kept).encode()
    assert fast.encode_lines([]) == b"" and fast.encode_lines(["", ""]) == b"\n\n"
    for bad in [" x", "x ", "a\nb", "a\rb", "x\u3000"]:
        with pytest.raises(ValueError, match="stripped lines"):
            fast.encode_lines(["ok", bad])
    with pytest.raises(ValueError, match="lone surrogate"):
        fast.encode_lines(["ok", "a\udc80b"])


def test_block_reading_gives_the_lines_of_iter_lines():
    import io
    import random

    from fairseq.data.encoders import _script_io

    rng = random.Random(4)
    pieces = [b"a", b"bc", b" ", b"\n", b"\r", b"\r\n", b"\n\n", "é日\x85\u2028".encode(), b"\x0b", b"\x0c"]
    for trial in range(300):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 60)))
        want = [line.rstrip("\r\n") for line in _script_io.iter_lines(io.BytesIO(data), "x")]
        blocks = list(_script_io.iter_blocks(io.BytesIO(data), size=rng.randint(1, 8)))
        assert b"".join(b for b, _ in blocks) == data
        got, lineno = [], 0
        for block, before in blocks:
            assert before == lineno and (block.endswith(b"\n") or block is blocks[-1][0])
            lines = _script_io.split_lines(block, "x", before)
            assert len(lines) == _script_io.count_lines(block)
            got += lines
            lineno += len(lines)
        assert got == want, data
    with pytest.raises(_script_io.ScriptError, match="f.txt, line 7: not valid UTF-8"):
        _script_io.split_lines(b"ok\r\nok\xff\n", "f.txt", 5)


def test_duplicate_merges_keep_their_last_rank_and_a_missing_final_newline_drops_the_last_merge(tmp_path):
    chars = ref_byte_chars()
    vocab = {c: i for i, c in enumerate(chars.values())}
    for tok in ("ab", "bc", "cd", "abc"):
        vocab[tok] = len(vocab)
    enc = tmp_path / "encoder.json"
    enc.write_text(json.dumps(vocab), encoding="utf-8")
    bpe = tmp_path / "vocab.bpe"
    bpe.write_text("#version: 0.2\na b\nb c\na b\nab c\nc d", encoding="utf-8")  # no final newline: "c d" unused
    e, r = gpt2_bpe_utils.get_encoder(enc, bpe), ReferenceGPT2(enc, bpe)
    for text in ["abc", "abcd", "ab", "cd", "bcd abcd"]:
        assert e.encode(text) == r.encode(text)
    assert e.encode("abc") == [vocab["a"], vocab["bc"]]  # "a b" ranks after "b c" (its last line)
    assert e.encode("cd") == [vocab["c"], vocab["d"]]


def test_a_token_missing_from_encoder_json_fails_only_where_upstream_fails(tmp_path, gpt2_files):
    vocab = json.loads(gpt2_files[0].read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in gpt2_files[1].read_text(encoding="utf-8").split("\n")[1:-1]]
    del vocab["Ġthe"]  # a merge result
    del vocab[ref_byte_chars()[0]]  # the byte 0x00
    enc, bpe = write_gpt2_files(tmp_path, vocab, merges, extra_tokens=())
    e, r = gpt2_bpe_utils.get_encoder(enc, bpe), ReferenceGPT2(enc, bpe)
    assert e.engine == "tokenizers" and e._has_missing
    assert e.encode("a cat sat") == r.encode("a cat sat")
    for text in ["in the end", "a\x00b"]:
        with pytest.raises(KeyError):
            r.encode(text)
        with pytest.raises(ValueError, match="has no id in .*encoder.json.*do not belong together"):
            e.encode(text)
    with pytest.raises(ValueError, match="'Ġthe'"):
        e.encode_batch(["fine", "then the"])


def test_lone_surrogates_are_a_value_error(fast):
    with pytest.raises(ValueError, match="lone surrogate"):
        fast.encode("abc\udc80def")
    with pytest.raises(TypeError):
        fast.encode_batch(["ok", b"bytes"])


# ---- GPT-2: decoding and the `--bpe gpt2` object ----------------------------------------------------------
def test_gpt2bpe_encode_decode_and_word_beginnings(gpt2_files, fast):
    bpe = GPT2BPE(GPT2BPEConfig(gpt2_encoder_json=str(gpt2_files[0]), gpt2_vocab_bpe=str(gpt2_files[1])))
    text = "Hello world, the  end.\n"
    encoded = bpe.encode(text)
    assert encoded == " ".join(map(str, fast.encode(text)))
    assert all(tok.isdigit() for tok in encoded.split())
    assert bpe.decode(encoded) == text
    assert bpe.decode("<s> " + bpe.encode(" x") + " </s> <unk> <mask>") == "<s> x</s><unk><mask>"
    the = str(fast.encoder["Ġthe"])
    assert bpe.is_beginning_of_word(the) and not bpe.is_beginning_of_word(str(fast.encoder["the"]))
    assert not bpe.is_beginning_of_word("<s>")
    # a lone byte of a multi-byte character decodes to U+FFFD (upstream's errors="replace")
    first_byte = str(fast.encoder[ref_byte_chars()["é".encode()[0]]])
    assert bpe.decode(first_byte) == "\ufffd" and not bpe.is_beginning_of_word(first_byte)


def test_gpt2_decode_errors(gpt2_files, fast):
    bpe = GPT2BPE(GPT2BPEConfig(gpt2_encoder_json=str(gpt2_files[0]), gpt2_vocab_bpe=str(gpt2_files[1])))
    with pytest.raises(ValueError, match=r"id 999999 is not in .*encoder.json"):
        bpe.decode("31 999999")
    with pytest.raises(ValueError, match="'madeupword0000' is not a GPT-2 id"):
        bpe.decode("31 madeupword0000")
    strict = gpt2_bpe_utils.Encoder(fast.encoder, list(fast.bpe_ranks), errors="strict")
    with pytest.raises(ValueError, match="not form valid UTF-8"):
        strict.decode([fast.encoder[ref_byte_chars()["é".encode()[0]]]])
    assert fast.bpe("Ġthe") == "Ġthe" and fast.bpe("Ġthe").split() == [fast.decoder[i] for i in fast.encode(" the")]


def test_gpt2_file_errors_name_the_file_and_the_fix(tmp_path, gpt2_files):
    enc, bpe = gpt2_files
    with pytest.raises(ValueError, match="--gpt2-encoder-json.*dl.fbaipublicfiles.com/fairseq/gpt2_bpe/encoder.json"):
        build_bpe("gpt2")
    with pytest.raises(ValueError, match="is a URL"):
        GPT2BPE(GPT2BPEConfig(gpt2_encoder_json=gpt2_bpe_utils.ENCODER_JSON_URL, gpt2_vocab_bpe=str(bpe)))
    missing = tmp_path / "nope" / "encoder.json"
    with pytest.raises(
        FileNotFoundError, match=f"{missing}.*does not exist.*pass the encoder.json the data was encoded with"
    ) as err:
        gpt2_bpe_utils.get_encoder(missing, bpe)
    assert "wget" not in str(err.value)  # the user's own file is missing: GPT-2's would encode other ids
    cases = {
        "not json {": "not valid JSON",
        "[1, 2]": "must hold one JSON object",
        '{"a": "1"}': "ids must be integers",
        '{"a": 1, "b": 1}': "id 1 is given to both",
    }
    for content, message in cases.items():
        bad = tmp_path / "bad_encoder.json"
        bad.write_text(content, encoding="utf-8")
        with pytest.raises(ValueError, match=f"bad_encoder.json.*{message}"):
            gpt2_bpe_utils.get_encoder(bad, bpe)
    bad = tmp_path / "bad.bpe"
    bad.write_text("a b\nc d\n", encoding="utf-8")
    with pytest.raises(ValueError, match="bad.bpe.*'#version: 0.2'"):
        gpt2_bpe_utils.get_encoder(enc, bad)
    bad.write_text("#version: 0.2\na b\nc d 17\n", encoding="utf-8")  # fastBPE codes are not vocab.bpe
    with pytest.raises(ValueError, match="bad.bpe.*line 3.*two space-separated"):
        gpt2_bpe_utils.get_encoder(enc, bad)
    bad.write_bytes(b"#version: 0.2\n\xff\xfe b\n")
    with pytest.raises(ValueError, match="bad.bpe.*not UTF-8"):
        gpt2_bpe_utils.get_encoder(enc, bad)


def test_byte_table_is_gpt2s():
    table = gpt2_bpe_utils.bytes_to_unicode()
    assert table == ref_byte_chars()
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[0] == "Ā" and table[0xAD] == "Ń"


# ---- sentencepiece, bytes, characters, tokenizers -----------------------------------------------------------
@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    return train_spm_model(tmp_path_factory.mktemp("spm"))


def test_sentencepiece_bpe_as_upstream(spm_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    bpe = build_bpe(
        argparse.Namespace(
            bpe="sentencepiece",
            sentencepiece_model=str(spm_model),
            sentencepiece_enable_sampling=False,
            sentencepiece_alpha=None,
        )
    )
    text = "The quick  brown fox, jumps."
    assert bpe.encode(text) == " ".join(sp.encode(text, out_type=str))
    assert bpe.decode(bpe.encode(text)) == "The quick brown fox, jumps."
    assert bpe.decode("▁he llo ▁world") == "hello world"
    assert bpe.is_beginning_of_word("▁the") and not bpe.is_beginning_of_word("ing")
    assert all(bpe.is_beginning_of_word(s) for s in ("<unk>", "<s>", "</s>", "<pad>"))


def test_sentencepiece_errors(tmp_path):
    with pytest.raises(ValueError, match="--sentencepiece-model"):
        build_bpe("sentencepiece")
    with pytest.raises(FileNotFoundError, match="nope.model.*does not exist.*spm_train.py"):
        build_bpe({"_name": "sentencepiece", "sentencepiece_model": str(tmp_path / "nope.model")})
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"this is not a model")
    with pytest.raises(ValueError, match="junk.model.*could not be loaded"):
        build_bpe({"_name": "sentencepiece", "sentencepiece_model": str(junk)})


def test_bytes_and_characters():
    b, c = build_bpe("bytes"), build_bpe("characters")
    assert b.encode("a b") == "a ▁ b"
    assert b.encode("é\t\n x") == "Ã © ▁ x"  # the whitespace run becomes one space, shown as ▁
    for text in ["hello world", "日本語 😀", "a b"]:
        assert b.decode(b.encode(text)) == text
        assert c.decode(c.encode(text)) == text
    broken = b.encode("aé")  # "a Ã ©": drop the last byte of é
    assert b.decode(broken.rsplit(" ", 1)[0]) == "a"
    assert b.decode(b.encode("é") + " " + b.encode("x")) == "éx"
    assert c.encode("ab c") == "a b ▁ c"
    with pytest.raises(ValueError, match="not a byte character"):
        b.decode("€")


def test_bytes_encode_shows_non_printable_bytes_above_256():
    b = build_bpe("bytes")
    assert b.encode("\x00") == chr(256)
    assert b.encode("\u00ad") == f"Â {chr(256 + 0xAD)}"  # soft hyphen: 0xC2 is printable, 0xAD is not
    assert b.encode("\u00a0") == "▁"  # no-break space is whitespace: normalized to a space first


def test_space_and_nltk_tokenizers(monkeypatch):
    assert build_tokenizer("space").encode("a \t b\n") == "a b "
    assert build_tokenizer(argparse.Namespace(tokenizer=None)) is None
    monkeypatch.setitem(sys.modules, "nltk", None)
    monkeypatch.setitem(sys.modules, "nltk.tokenize", None)
    with pytest.raises(ImportError, match="pip install nltk"):
        build_tokenizer("nltk")
    fake = types.ModuleType("nltk.tokenize")
    fake.word_tokenize = lambda s: s.replace(",", " ,").split()
    monkeypatch.setitem(sys.modules, "nltk", types.ModuleType("nltk"))
    monkeypatch.setitem(sys.modules, "nltk.tokenize", fake)
    tok = build_tokenizer("nltk")
    assert tok.encode("a, b") == "a , b" and tok.decode("a , b") == "a , b"


# ---- the registry --------------------------------------------------------------------------------------------
def test_registry_names_and_upstream_dict_access():
    assert {"gpt2", "sentencepiece", "bytes", "characters"} <= set(BPE_REGISTRY.choices())
    assert {"space", "nltk"} <= set(TOKENIZER_REGISTRY.choices())
    assert "gpt2" in BPE_REGISTRY and BPE_REGISTRY["gpt2"] is GPT2BPE and "gpt2" in BPE_REGISTRY.keys()
    assert BPE_REGISTRY.dataclass("gpt2") is GPT2BPEConfig
    assert build_bpe(None) is None and build_bpe(argparse.Namespace(bpe=None)) is None
    with pytest.raises(
        ValueError,
        match=r"unknown bpe 'gpt3' for --bpe \(did you mean 'gpt2'\?\); choose one of: bytes, "
        "characters, gpt2",
    ):
        build_bpe("gpt3")


def test_build_bpe_from_every_kind_of_config(gpt2_files):
    from omegaconf import OmegaConf

    enc, bpe = map(str, gpt2_files)
    configs = [
        argparse.Namespace(bpe="gpt2", gpt2_encoder_json=enc, gpt2_vocab_bpe=bpe, other_flag=1),
        {"_name": "gpt2", "gpt2_encoder_json": enc, "gpt2_vocab_bpe": bpe},
        OmegaConf.create({"_name": "gpt2", "gpt2_encoder_json": enc, "gpt2_vocab_bpe": bpe}),
        OmegaConf.create({"bpe": {"_name": "gpt2", "gpt2_encoder_json": enc, "gpt2_vocab_bpe": bpe}}),
        GPT2BPEConfig(gpt2_encoder_json=enc, gpt2_vocab_bpe=bpe),
    ]
    for cfg in configs:
        built = build_bpe(cfg)
        assert isinstance(built, GPT2BPE)
        assert built.decode(built.encode("Hello there")) == "Hello there"


def test_scheme_dataclasses_generate_upstreams_flags(gpt2_files, spm_model):
    """How the CLIs will add the flags: the chosen scheme's dataclass through add_dataclass_to_parser."""
    from fairseq.dataclass.utils import add_dataclass_to_parser, config_from_namespace

    parser = argparse.ArgumentParser()
    parser.add_argument("--bpe", choices=BPE_REGISTRY.choices())
    for name in ("gpt2", "sentencepiece"):
        add_dataclass_to_parser(parser, BPE_REGISTRY.dataclass(name))
    flags = set(parser._option_string_actions)
    assert {
        "--gpt2-encoder-json",
        "--gpt2-vocab-bpe",
        "--sentencepiece-model",
        "--sentencepiece-enable-sampling",
        "--sentencepiece-alpha",
    } <= flags
    args = parser.parse_args(
        ["--bpe", "gpt2", "--gpt2-encoder-json", str(gpt2_files[0]), "--gpt2-vocab-bpe", str(gpt2_files[1])]
    )
    assert build_bpe(args).decode(build_bpe(args).encode("x y")) == "x y"
    cfg = config_from_namespace(BPE_REGISTRY.dataclass(args.bpe), args, name=args.bpe)
    assert isinstance(build_bpe(cfg), GPT2BPE)
    args = parser.parse_args(["--bpe", "sentencepiece", "--sentencepiece-model", str(spm_model)])
    assert build_bpe(args).encode("the").startswith("▁")
