"""--task streaming_language_modeling on 2 gloo ranks: the ranks' batches are disjoint slices of one global
sequence that covers a corpus's pass once, in order."""

import math


from tests.streaming_fixtures import write_jsonl_corpora
from tests.train_fixtures import spawn_scenarios

BATCH = 3


def _make_stream(data):
    from fairseq.data.stream_blocks import CorpusStream
    from fairseq.data.stream_iterator import GlobalStream
    from fairseq.data.stream_tokenizer import TokenizerSpec

    spec = TokenizerSpec("fairseq", (str(data / "dict.txt"),))
    return GlobalStream(
        [CorpusStream("web", [str(data / "train" / "00" / "web.jsonl")], spec, 16, "complete", 2)], {"web": 1.0}, seed=1
    )


def rank_scenarios(rank, data, steps):
    import torch.distributed as dist

    from fairseq.data.stream_iterator import StreamingEpochIterator

    def cover():
        itr = StreamingEpochIterator(
            lambda: _make_stream(data),
            BATCH,
            1,
            num_shards=dist.get_world_size(),
            shard_id=dist.get_rank(),
            log_tokens=False,
        )
        batches = itr.next_epoch_itr()
        mine = []
        for _ in range(steps):
            batch = next(batches)
            mine += [
                (g, [t for t in target if t != 1])  # without the padding (id 1)
                for g, target in zip(batch["id"].tolist(), batch["target"].tolist())
            ]
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return gathered

    return {"cover": cover}


def test_two_ranks_cover_a_pass_disjointly_in_global_order(tmp_path):
    from fairseq.data.stream_blocks import CorpusStream
    from fairseq.data.stream_tokenizer import TokenizerSpec

    data = write_jsonl_corpora(tmp_path / "d", corpora=("web",), docs=80)
    spec = TokenizerSpec("fairseq", (str(data / "dict.txt"),))
    one_pass = CorpusStream("web", [str(data / "train" / "00" / "web.jsonl")], spec, 16, "complete", 2, endless=False)
    blocks = []
    while (b := one_pass.next_block()) is not None:
        blocks.append(b[1].tolist())
    steps = math.ceil(len(blocks) / (2 * BATCH))
    results = spawn_scenarios(rank_scenarios, tmp_path, 2, data, steps)
    gathered = results[0]["cover"]
    assert not isinstance(gathered, Exception), gathered
    ids = [[g for g, _ in rank] for rank in gathered]
    assert set(ids[0]).isdisjoint(ids[1])
    assert sorted(ids[0] + ids[1]) == list(range(2 * BATCH * steps))
    assert ids[0][:BATCH] == [0, 1, 2] and ids[1][:BATCH] == [3, 4, 5]  # rank r: the r-th slice of a global batch
    by_id = dict(gathered[0] + gathered[1])
    assert [by_id[g] for g in range(len(blocks))] == blocks  # each block of the pass once, in order
    assert results[1]["cover"] == gathered
