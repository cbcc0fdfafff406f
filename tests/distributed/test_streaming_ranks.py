"""--task streaming_language_modeling on 2 gloo ranks: the ranks' batches are disjoint slices of one global
sequence that covers a corpus's pass once, in order; with --model-parallel-size 2 the two ranks (one
tensor-parallel group, one data-parallel rank) get the same batches, those of one process."""

import math

import pytest

from tests.streaming_fixtures import write_jsonl_corpora
from tests.train_fixtures import TINY_MODELS, spawn_scenarios

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


# ---- --model-parallel-size 2: one tensor-parallel group reads one data-parallel share ----------------------------
TP_FLAGS = [
    "--task",
    "streaming_language_modeling",
    "--data-weights",
    "web=0.7,books=0.3",
    *TINY_MODELS["transformer_lm_gpt"]["model"],
    "--optimizer",
    "adam",
    "--lr",
    "0.003",
    "--tokens-per-sample",
    "16",
    "--batch-size",
    "3",
    "--num-workers",
    "1",
    "--cpu",
    "--seed",
    "5",
    "--disable-validation",
    "--ddp-backend",
    "fully_sharded",
    "--model-parallel-size",
    "2",
    "--criterion",
    "vocab_parallel_cross_entropy",
]
TP_BATCHES = 3


def _batch_content(batch):
    return {
        "id": batch["id"].tolist(),
        "src": batch["net_input"]["src_tokens"].tolist(),
        "tgt": batch["target"].tolist(),
    }


def tp_scenarios(rank, data):
    """fairseq-train's own helpers on this rank: the config, task, model, Trainer (which builds the TP mesh) and
    the training iterator (trainer_iterator: the data-parallel rank and size of the mesh); the first batches
    it hands out, and the losses of two updates on them."""
    import torch.distributed as dist

    from fairseq import options, registry
    from fairseq.criterions import build_criterion
    from fairseq.distributed import utils as dist_utils
    from fairseq.distributed.parallelize import build_model
    from fairseq.frontend.validate import validate
    from fairseq.training.batch_iterators import trainer_iterator
    from fairseq.training.trainer import Trainer

    def batches():
        parser = options.get_training_parser()
        cfg = options.convert_namespace_to_config(options.parse_args_and_arch(parser, [str(data), *TP_FLAGS]))
        validate(cfg)
        task = registry.TASK_REGISTRY.get(cfg.task._name).setup_task(cfg.task)
        trainer = Trainer(cfg, task, build_model(cfg, task), build_criterion(cfg.criterion, task, cfg.optimization))
        epoch_itr = trainer_iterator(cfg, task, trainer, 1)
        itr = epoch_itr.next_epoch_itr()
        mine, losses = [], []
        for _ in range(TP_BATCHES):
            batch = next(itr)
            mine.append(_batch_content(batch))
            trainer.train_step([batch], epoch_itr)
            sums = trainer.read_train_stats()
            losses.append(sums["loss"] / sums["sample_size"])
        epoch_itr.close()
        layout = (dist_utils.get_data_parallel_world_size(), dist_utils.get_model_parallel_world_size())
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (layout, mine, losses))
        return gathered

    return {"batches": batches}


@pytest.mark.timeout(180)
def test_a_tensor_parallel_group_gets_the_same_batches(tmp_path):
    from fairseq.data.stream_blocks import CorpusStream
    from fairseq.data.stream_iterator import StreamingEpochIterator, GlobalStream
    from fairseq.data.stream_tokenizer import TokenizerSpec

    data = write_jsonl_corpora(tmp_path / "d", docs=60)
    results = spawn_scenarios(tp_scenarios, tmp_path, 2, data, timeout_s=120)
    gathered = results[0]["batches"]
    assert not isinstance(gathered, Exception), gathered
    (layout0, batches0, losses0), (layout1, batches1, losses1) = gathered
    assert layout0 == layout1 == (1, 2)  # one data-parallel rank of a TP group of 2
    assert batches0 == batches1  # both ranks of the group: the same samples, tokens and targets
    assert losses0 == losses1  # and the same loss (the TP model needs the same input on both)

    # Those batches are the first of the global sequence on one data-parallel rank.
    spec = TokenizerSpec("fairseq", (str(data / "dict.txt"),))
    streams = [
        CorpusStream(name, [str(data / "train" / "00" / f"{name}.jsonl")], spec, 16, "none", 2)
        for name in ("books", "web")  # find_corpora's order
    ]
    one = StreamingEpochIterator(
        lambda: GlobalStream(streams, {"web": 0.7, "books": 0.3}, seed=5), 3, 1, log_tokens=False
    )
    batches = one.next_epoch_itr()
    assert [_batch_content(next(batches)) for _ in range(TP_BATCHES)] == batches0
    one.close()
