"""EpochBatchIterator: per-epoch shuffling, sharding, exact mid-epoch resume, grouping, worker loading."""

import numpy as np
import pytest
import torch

from fairseq.data.batching import Batches
from fairseq.data.iterators import CountingIterator, EpochBatchIterator, GroupedIterator


class SquaresDataset(torch.utils.data.Dataset):
    """Item i is the tensor [i, i * i]; the collater stacks them and records the ids."""

    def __len__(self):
        return 100

    def __getitem__(self, i):
        return torch.tensor([i, i * i])

    def collater(self, items):
        if not items:
            return {}
        stacked = torch.stack(items)
        return {"id": stacked[:, 0], "square": stacked[:, 1]}


# 10 batches of dataset indices: batch b holds 3b, 3b+1 (batch 9 holds 27 only).
BATCHES = [[3 * b, 3 * b + 1] for b in range(9)] + [[27]]


def make_iterator(**kwargs):
    dataset = SquaresDataset()
    return EpochBatchIterator(dataset, dataset.collater, BATCHES, **kwargs)


def batch_ids(samples):
    """Which of BATCHES each sample is (-1 for an empty padding batch)."""
    return [sample["id"][0].item() // 3 if sample else -1 for sample in samples]


def test_epoch_order_is_upstreams_shuffle_of_seed_plus_epoch():
    itr = make_iterator(seed=1)
    epoch1 = batch_ids(itr.next_epoch_itr(shuffle=True))
    assert itr.epoch == 1
    assert epoch1 == np.random.RandomState(2).permutation(10).tolist()
    assert epoch1 == [4, 1, 5, 0, 7, 2, 3, 6, 9, 8]  # pinned: resumes across versions depend on it
    epoch2 = batch_ids(itr.next_epoch_itr(shuffle=True))
    assert itr.epoch == 2 and epoch2 == np.random.RandomState(3).permutation(10).tolist()
    again = make_iterator(seed=1)
    assert batch_ids(again.next_epoch_itr()) == epoch1
    other_seed = make_iterator(seed=7)
    assert batch_ids(other_seed.next_epoch_itr()) != epoch1


def test_unshuffled_epoch_keeps_batch_order_and_samples_hold_the_items():
    itr = make_iterator()
    samples = list(itr.next_epoch_itr(shuffle=False))
    assert batch_ids(samples) == list(range(10))
    assert samples[2]["id"].tolist() == [6, 7] and samples[2]["square"].tolist() == [36, 49]
    assert samples[9]["id"].tolist() == [27]


def test_shards_get_equal_numbers_of_batches_padded_with_empty_ones():
    per_shard = []
    for shard_id in range(3):
        itr = make_iterator(seed=1, num_shards=3, shard_id=shard_id)
        assert len(itr) == 4
        per_shard.append(batch_ids(itr.next_epoch_itr()))
    order = [4, 1, 5, 0, 7, 2, 3, 6, 9, 8]
    assert per_shard == [order[0::3], order[1::3] + [-1], order[2::3] + [-1]]
    real = sorted(b for ids in per_shard for b in ids if b >= 0)
    assert real == list(range(10))


def test_bad_shard_and_worker_arguments():
    with pytest.raises(ValueError, match="shard_id 3"):
        make_iterator(num_shards=3, shard_id=3)
    with pytest.raises(ValueError, match="--num-workers"):
        make_iterator(num_workers=-1)


def test_resume_mid_epoch_yields_exactly_the_remaining_batches():
    first = make_iterator(seed=5)
    list(first.next_epoch_itr())
    assert first.end_of_epoch() and first.next_epoch_idx == 2
    epoch2 = first.next_epoch_itr()
    consumed = [next(epoch2) for _ in range(4)]
    assert first.iterations_in_epoch == 4
    state = first.state_dict()
    assert state == {"version": 2, "epoch": 2, "iterations_in_epoch": 4, "shuffle": True}

    resumed = make_iterator(seed=5)
    resumed.load_state_dict(state)
    assert resumed.iterations_in_epoch == 4 and resumed.next_epoch_idx == 2
    rest = resumed.next_epoch_itr()
    assert resumed.epoch == 2
    assert rest.n == 4 and len(rest) == 10
    full_epoch2 = np.random.RandomState(5 + 2).permutation(10).tolist()
    assert batch_ids(consumed) + batch_ids(rest) == full_epoch2
    assert resumed.end_of_epoch()
    assert resumed.state_dict() == {"version": 2, "epoch": 3, "iterations_in_epoch": 0, "shuffle": True}
    assert batch_ids(resumed.next_epoch_itr()) == np.random.RandomState(5 + 3).permutation(10).tolist()


def test_asking_again_mid_epoch_restarts_the_same_epoch():
    itr = make_iterator(seed=5)
    epoch1 = itr.next_epoch_itr()
    next(epoch1)
    assert itr.next_epoch_idx == 1
    assert batch_ids(itr.next_epoch_itr()) == np.random.RandomState(6).permutation(10).tolist()


def test_resume_keeps_the_saved_shuffle_flag():
    itr = make_iterator()
    epoch = itr.next_epoch_itr(shuffle=False)
    next(epoch)
    state = itr.state_dict()
    assert state["shuffle"] is False
    resumed = make_iterator()
    resumed.load_state_dict(state)
    assert batch_ids(resumed.next_epoch_itr()) == list(range(1, 10))


def test_state_at_start_and_resume_position_past_the_epoch():
    itr = make_iterator(epoch=3)
    assert itr.state_dict() == {"version": 2, "epoch": 3, "iterations_in_epoch": 0, "shuffle": True}
    itr.load_state_dict({"epoch": 2, "iterations_in_epoch": 0})
    assert itr.next_epoch_idx == 2
    with pytest.raises(RuntimeError, match="--reset-dataloader"):
        itr.load_state_dict({"epoch": 2, "iterations_in_epoch": 11})


def test_grouped_iterator_counts_groups_and_resumes_from_the_batch_position():
    itr = make_iterator()
    grouped = GroupedIterator(itr.next_epoch_itr(shuffle=False), 3)
    assert len(grouped) == 4 and grouped.n == 0
    groups = []
    for group in grouped:
        groups.append(batch_ids(group))
        assert grouped.n == len(groups)
    assert groups == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert itr.iterations_in_epoch == 10

    itr = make_iterator()
    epoch = itr.next_epoch_itr(shuffle=False)
    next(epoch), next(epoch), next(epoch)
    resumed = make_iterator()
    resumed.load_state_dict(itr.state_dict())
    grouped = GroupedIterator(resumed.next_epoch_itr(shuffle=False), 3)
    assert grouped.n == 1 and len(grouped) == 4
    assert [batch_ids(g) for g in grouped] == [[3, 4, 5], [6, 7, 8], [9]]
    with pytest.raises(ValueError, match="--update-freq"):
        GroupedIterator(CountingIterator([1]), 0)


def test_counting_iterator_take_and_skip():
    itr = CountingIterator(range(10))
    assert itr.skip(3).n == 3
    itr.take(5)
    assert list(itr) == [3, 4] and itr.n == 5 and not itr.has_next()
    short = CountingIterator(iter([1, 2]), total=3)
    next(short), next(short)
    with pytest.raises(IndexError, match="expected 3 items but ended after 2"):
        next(short)


def test_two_workers_load_the_same_batches_as_in_process():
    in_process = make_iterator(seed=3, num_workers=0)
    workers = make_iterator(seed=3, num_workers=2, buffer_size=2)
    for _ in range(2):  # two epochs: workers restart every epoch
        a = list(in_process.next_epoch_itr())
        b = list(workers.next_epoch_itr())
        assert len(a) == len(b) == 10
        for x, y in zip(a, b):
            assert torch.equal(x["id"], y["id"]) and torch.equal(x["square"], y["square"])


def test_pin_memory_is_only_requested_with_cuda():
    assert make_iterator(pin_memory=True).pin_memory == torch.cuda.is_available()
    assert make_iterator(pin_memory=False).pin_memory is False


def test_first_batch_and_batches_container():
    itr = make_iterator()
    assert itr.first_batch["id"].tolist() == [0, 1]
    batches = Batches.from_list(BATCHES)
    assert len(batches) == 10 and batches[9].tolist() == [27] and batches[-1].tolist() == [27]
    assert batches.to_list() == BATCHES
    assert batches.sizes().tolist() == [2] * 9 + [1]
    with pytest.raises(IndexError):
        batches[10]
    empty = EpochBatchIterator(SquaresDataset(), SquaresDataset().collater, [])
    assert len(empty) == 0 and empty.first_batch == "DUMMY" and list(empty.next_epoch_itr()) == []


def test_many_batches_are_cheap():
    # A million batches: stored as two arrays; creating the iterator and one epoch's order is fast.
    batches = Batches(np.arange(2_000_000), np.arange(0, 2_000_001, 2))
    itr = EpochBatchIterator(SquaresDataset(), SquaresDataset().collater, batches, num_shards=8, shard_id=7)
    assert len(itr) == 125_000
    order = itr.batch_order(epoch=1, shuffle=True)
    assert len(order) == 125_000 and (order >= 0).all()
