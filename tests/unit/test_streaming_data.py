"""The streaming task's data path: blocks equal to the data-bin route's (fairseq-preprocess --json-key + the
TokenBlockDataset) for every break mode and tokenizer, exact resume of a corpus stream, the mixture's rates, and
the global order whatever the number of data-parallel ranks."""

import json
import math

import numpy as np
import pytest
import torch

from fairseq.data import Dictionary
from fairseq.data.indexed_dataset import MMapIndexedDataset
from fairseq.data.stream_blocks import CorpusStream
from fairseq.data.stream_iterator import GlobalStream, StreamingEpochIterator, parse_weights, rates_from_sizes
from fairseq.data.stream_tokenizer import TokenizerSpec, bpe_spec_of
from fairseq.data.token_block_dataset import TokenBlockDataset
from fairseq_cli import preprocess
from tests.streaming_fixtures import write_jsonl_corpora
from tests.text_fixtures import sample_text, train_gpt2_files, train_spm_model

MODES = ("none", "complete", "complete_doc", "eos")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl_corpora(tmp_path_factory.mktemp("jsonl") / "d", corpora=("web", "books"), docs=150)


def stream_blocks(files, spec, block, mode, eos):
    stream = CorpusStream("c", [str(f) for f in files], spec, block, mode, eos, endless=False)
    out = []
    while (b := stream.next_block()) is not None:
        out.append(b)
    return out


def data_bin_blocks(bin_dir, block, mode):
    ds = MMapIndexedDataset(str(bin_dir / "train"))
    d = Dictionary.load(str(bin_dir / "dict.txt"))
    tb = TokenBlockDataset(ds, ds.sizes, block, d.pad(), d.eos(), break_mode=mode, include_targets=True)
    return [tb[i][:2] for i in range(len(tb))]


def assert_same_blocks(got, want):
    assert len(got) == len(want)
    for (gs, gt), (ws, wt) in zip(got, want):
        assert torch.equal(gt, wt) and torch.equal(gs, ws)


@pytest.mark.parametrize("bpe", [None, "gpt2", "sentencepiece"])
def test_blocks_equal_the_data_bin_route_for_every_break_mode(data, tmp_path, bpe):
    files = [data / "train" / "00" / "web.jsonl", data / "train" / "00" / "books.jsonl"]
    argv = ["--only-source", "--json-key", "text", "--trainpref", str(data / "train"), "--destdir", str(tmp_path)]
    bpe_values = None
    if bpe == "gpt2":
        enc, vocab = train_gpt2_files(tmp_path, sample_text()[:100000], vocab_size=400)
        argv += ["--bpe", "gpt2", "--gpt2-encoder-json", str(enc), "--gpt2-vocab-bpe", str(vocab)]
        bpe_values = bpe_spec_of("gpt2", {"gpt2_encoder_json": str(enc), "gpt2_vocab_bpe": str(vocab)})
    elif bpe == "sentencepiece":
        model = train_spm_model(tmp_path, sample_text()[:100000], vocab_size=200)
        argv += ["--bpe", "sentencepiece", "--sentencepiece-model", str(model)]
        bpe_values = bpe_spec_of("sentencepiece", {"sentencepiece_model": str(model)})
    else:
        argv += ["--srcdict", str(data / "dict.txt")]
    preprocess.cli_main(argv)
    spec = TokenizerSpec("fairseq", (str(tmp_path / "dict.txt"),), bpe=bpe_values)
    eos = Dictionary.load(str(tmp_path / "dict.txt")).eos()
    for mode in MODES:
        # corpora in the streaming task's order (books, web), one stream: the data-bin split holds both
        got = stream_blocks(sorted(files), spec, 40, mode, eos)
        assert_same_blocks(got, data_bin_blocks(tmp_path, 40, mode))


def test_a_line_longer_than_the_block_is_cut_into_pieces(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": " ".join(["w1"] * 25) + "\nw2 w3"}) + "\n")
    (tmp_path / "dict.txt").write_text("w1 1\nw2 1\nw3 1\n")
    spec = TokenizerSpec("fairseq", (str(tmp_path / "dict.txt"),))
    blocks = stream_blocks([tmp_path / "c.jsonl"], spec, 10, "complete", 2)
    assert [len(t) for _, t in blocks] == [10, 10, 6, 4]  # 25 words + </s>, then "w2 w3 </s>" + end of document
    assert int(blocks[1][0][0]) == int(blocks[0][1][-1])  # a piece's source starts with the token before it


def test_corpus_stream_resumes_exactly_from_its_state(data):
    spec = TokenizerSpec("fairseq", (str(data / "dict.txt"),))
    files = [str(data / "train" / "00" / "web.jsonl")]
    for mode in MODES:
        whole = stream_blocks(files, spec, 24, mode, 2)
        first = CorpusStream("web", files, spec, 24, mode, 2, endless=False)
        head = [first.next_block() for _ in range(37)]
        state = first.state()
        first.close()
        again = CorpusStream("web", files, spec, 24, mode, 2, endless=False)
        again.load_state(state)
        rest = []
        while (b := again.next_block()) is not None:
            rest.append(b)
        assert_same_blocks(head + rest, whole)


def test_hf_tokenizer_ids_are_the_tokenizers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "a": 4, "b": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "a b z\nb"}) + "\n")
    spec = TokenizerSpec("hf", (str(tmp_path / "tokenizer.json"),))
    [(source, target)] = stream_blocks([tmp_path / "c.jsonl"], spec, 16, "none", 2)
    assert target.tolist() == [4, 5, 3, 2, 5, 2, 2]
    assert source.tolist() == [2, 4, 5, 3, 2, 5, 2]


def test_mixture_rates_within_4_sigma_over_1e5_samples(data):
    spec = TokenizerSpec("fairseq", (str(data / "dict.txt"),))
    corpora = [
        CorpusStream(name, [str(data / "train" / "00" / f"{name}.jsonl")], spec, 8, "none", 2)
        for name in ("web", "books")
    ]
    rates = parse_weights("web=0.7,books=0.3", ["web", "books"])
    stream = GlobalStream(corpora, rates, seed=5)
    n = 100_000
    web = int(np.count_nonzero(stream.picks(0, n) == 0))  # the choices take() makes for samples 0..n-1
    assert abs(web - 0.7 * n) <= 4 * math.sqrt(n * 0.7 * 0.3)
    items = stream.take(3000)  # the samples follow those choices; tokens are counted per corpus
    assert [i["corpus"] == "web" for i in items] == (stream.picks(0, 3000) == 0).tolist()
    assert stream.tokens["web"] == sum(len(i["target"]) for i in items if i["corpus"] == "web")
    assert GlobalStream(corpora, rates, seed=5).picks(0, n).tolist() == stream.picks(0, n).tolist()  # seeded


def test_alpha_smoothing_and_weights():
    assert rates_from_sizes({"a": 90.0, "b": 10.0}, 1.0, -1) == pytest.approx({"a": 0.9, "b": 0.1})
    assert rates_from_sizes({"a": 90.0, "b": 10.0}, 0.5, -1) == pytest.approx({"a": 0.75, "b": 0.25})
    assert rates_from_sizes({"a": 90.0, "b": 10.0}, 1.0, 10) == pytest.approx({"a": 0.5, "b": 0.5})
    assert parse_weights("a=3,b=1", ["a", "b", "c"]) == {"a": 0.75, "b": 0.25, "c": 0.0}
    for text, message in (
        ("a=-1", "must be >= 0"),
        ("a=0,b=0", "all weights are 0"),
        ("zz=1", "corpus 'zz', which the data does not have"),
        ("a", "is not CORPUS=WEIGHT"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_weights(text, ["a", "b"])


def global_ids(data, plan, batch_size=3):
    """Sample ids (g) and targets taken by ranks in `plan` [(ranks, batches per rank), ...], each leg resumed
    from the state rank 0 saved at the end of the previous one."""
    spec = TokenizerSpec("fairseq", (str(data / "dict.txt"),))

    def make_stream():
        corpora = [
            CorpusStream(n, [str(data / "train" / "00" / f"{n}.jsonl")], spec, 16, "none", 2) for n in ("books", "web")
        ]
        return GlobalStream(corpora, {"books": 0.4, "web": 0.6}, seed=1)

    seen, state = [], None
    for ranks, steps in plan:
        per_rank = []
        for rank in range(ranks):
            itr = StreamingEpochIterator(make_stream, batch_size, 1, num_shards=ranks, shard_id=rank, log_tokens=False)
            if state is not None:
                itr.load_state_dict(state)
            batches = itr.next_epoch_itr()
            per_rank.append([next(batches) for _ in range(steps)])
            if rank == 0:
                next_state = itr.state_dict()
            itr.close()
        state = next_state
        for step in range(steps):
            for rank in range(ranks):
                batch = per_rank[rank][step]
                seen += list(zip(batch["id"].tolist(), [tuple(t) for t in batch["target"].tolist()]))
    return seen


def test_resume_on_another_number_of_ranks_continues_the_global_order(data):
    reference = global_ids(data, [(1, 18)])
    assert global_ids(data, [(2, 3), (1, 6), (3, 2)]) == reference
    assert [g for g, _ in reference] == list(range(54))


def test_gz_and_zst_shards_read_and_resume_as_plain_jsonl(data, tmp_path, monkeypatch):
    import gzip
    import sys

    import zstandard

    raw = (data / "train" / "00" / "web.jsonl").read_bytes()
    (tmp_path / "web.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "web.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    spec = TokenizerSpec("fairseq", (str(data / "dict.txt"),))
    plain = stream_blocks([data / "train" / "00" / "web.jsonl"], spec, 24, "none", 2)
    for name in ("web.jsonl.gz", "web.jsonl.zst"):
        assert_same_blocks(stream_blocks([tmp_path / name], spec, 24, "none", 2), plain)
        first = CorpusStream("web", [str(tmp_path / name)], spec, 24, "none", 2, endless=False)
        head = [first.next_block() for _ in range(20)]
        again = CorpusStream("web", [str(tmp_path / name)], spec, 24, "none", 2, endless=False)
        again.load_state(first.state())
        rest = []
        while (b := again.next_block()) is not None:
            rest.append(b)
        assert_same_blocks(head + rest, plain)
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as without the package: import fails
    with pytest.raises(
        ValueError,
        match=r"web.jsonl.zst: reading .jsonl.zst needs the zstandard package: pip "
        r"install 'fairseq\[zstd\]'",
    ):
        stream_blocks([tmp_path / "web.jsonl.zst"], spec, 24, "none", 2)
