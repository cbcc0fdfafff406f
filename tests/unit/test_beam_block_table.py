"""Beam search's reorder by index through a block table (fairseq.generation.step_model.StepModel.reorder_blocks,
CausalSelfAttention.take_parent_blocks, fairseq.kernels.decode_attention's block_rows) on the CPU: on the static
step path (the CUDA-graph path run eagerly), outputs long enough that blocks of CACHE_BLOCK slots fill and are
shared, the hypotheses equal those of the copy reorder it replaced (tokens and scores, exactly) and the
step-by-step loop's tokens; a reorder writes at most one block per row and layer (the copy reorder wrote every
live slot); the table follows rows that leave the batch. The kernel through tables in Triton's interpreter:
tests/unit/test_decode_attention.py; under CUDA graphs: tests/gpu/test_decode_attention_gpu.py."""

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq.generation.sequence_generator import SequenceGenerator
from fairseq.generation.step_model import StepModel
from fairseq.kernels.decode_attention import CACHE_BLOCK
from fairseq.modules import CausalSelfAttention
from test_device_decoding import MIXED, decode, record_drops
from test_sequence_generator import D, W, EagerStaticGenerator, assert_same_hypotheses, build

pytestmark = pytest.mark.usefixtures("one_thread")

POSITIONS = 320  # outputs of up to ~200 tokens: three full blocks shared between hypotheses, a fourth filling


class CopyReorder(StepModel):
    """The reorder beam search's static path ran before the block table: each row's cache copied from its
    parent's over the whole capacity (CausalSelfAttention.reorder_incremental_state with a window)."""

    def use_block_table(self, states, block_rows):
        self.block_table = None

    def reorder_blocks(self, states, parents, slot):
        self.model.reorder_incremental_state(states, parents, self.graphed.capacity)


def static_generators(model, beam, **options):
    table = EagerStaticGenerator([model], D, beam_size=beam, **options)
    copy = EagerStaticGenerator([model], D, beam_size=beam, **options)
    copy.step_model.__class__ = CopyReorder
    return table, copy


def assert_equal_hypotheses(got, expected):
    assert len(got) == len(expected)
    for got_sentence, expected_sentence in zip(got, expected):
        assert len(got_sentence) == len(expected_sentence)
        for a, b in zip(got_sentence, expected_sentence):
            for key in ("tokens", "positional_scores", "score"):
                assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(
    "options", [dict(max_len_b=150, min_len=135), dict(max_len_b=140), dict(max_len_b=90, min_len=70, len_penalty=0.5)]
)
@pytest.mark.parametrize("beam", [2, 4, 5])
def test_the_block_table_gives_the_copy_reorders_hypotheses_and_the_step_by_step_loops_tokens(beam, options):
    model = build(seed=4, max_target_positions=POSITIONS)
    table, copy = static_generators(model, beam, **options)
    # MIXED: several sentences, prompts of different lengths (forced prefixes), a forced </s>, a forced <unk>
    got = decode(table, MIXED)
    assert_equal_hypotheses(got, decode(copy, MIXED))
    stepwise = SequenceGenerator([model], D, beam_size=beam, device_loop=False, **options)
    assert_same_hypotheses(got, decode(stepwise, MIXED))  # its batch shrinks: scores ~1e-6 apart
    assert max(len(h["tokens"]) for s in got for h in s) > (2 if options["max_len_b"] > 128 else 1) * CACHE_BLOCK


@pytest.mark.parametrize("beam", [2, 4])
def test_the_table_follows_the_rows_when_sentences_leave_the_batch(beam):
    model = build(seed=4, max_target_positions=POSITIONS)
    options = dict(max_len_b=200, min_len=150)
    table, copy = static_generators(model, beam, **options)
    drops = record_drops(table)
    # five sentences run as eight; the last one ends after ~160 tokens, when the others' rows share full blocks,
    # and the other four move into four sentences' rows
    prompts = MIXED[:4] + MIXED[5:6]
    got = decode(table, prompts)
    assert_equal_hypotheses(got, decode(copy, prompts))
    assert [(rows, new) for rows, new, _ in drops] == [(5 * beam, 4 * beam)]
    assert min(len(h["tokens"]) for h in got[4]) > 2 * CACHE_BLOCK


class CopiedSlots(TorchDispatchMode):
    """Counts the cache slots (per row, layer and buffer) that ops read into new tensors: a reorder gathers
    what it copies before writing it (in-place writes are not counted again)."""

    def __init__(self, slot_size: int):
        super().__init__()
        self.slot_size, self.elements = slot_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func._schema.is_mutable or func.is_view):
            self.elements += sum(
                t.numel() for t in pytree.tree_leaves(out) if torch.is_tensor(t) and t.is_floating_point()
            )
        return out


@pytest.mark.parametrize("reorder", ["table", "copy"])
def test_a_reorder_copies_one_block_per_row_and_layer(reorder):
    """Every reorder of a beam decode, whatever the length, copies one block of CACHE_BLOCK slots per row, layer
    and buffer (keys, values). The copy reorder it replaced copied every live slot (checked here too: this test
    fails for it)."""
    model = build(seed=4, max_target_positions=POSITIONS)
    generator = static_generators(model, 4, max_len_b=200, min_len=180)[reorder == "copy"]
    layers, heads, head_dim = 2, 2, 8  # build()'s: 2 layers of 2 heads over 16 dims
    copied = []
    original = type(generator.step_model).reorder_blocks

    def counted(self, states, parents, slot):
        with CopiedSlots(heads * head_dim) as mode:
            original(self, states, parents, slot)
        copied.append((int(slot), mode.elements / (heads * head_dim * layers * 2 * parents.numel())))

    generator.step_model.reorder_blocks = counted.__get__(generator.step_model)
    decode(generator, MIXED[:3])
    assert max(slot for slot, _ in copied) > 3 * CACHE_BLOCK  # the caches hold three full blocks and more
    if reorder == "table":
        assert {slots for _, slots in copied} == {CACHE_BLOCK}
    else:
        assert all(slots > slot for slot, slots in copied)


def test_take_parent_blocks_copies_the_block_of_the_slot_from_each_parent():
    attention = CausalSelfAttention(8, 2)
    state = {}
    entry = attention._cache_entry(state)
    capacity = 3 * CACHE_BLOCK
    entry["key_buffer"], entry["value_buffer"] = torch.randn(4, 2, capacity, 4), torch.randn(4, 2, capacity, 4)
    before = {name: entry[name].clone() for name in ("key_buffer", "value_buffer")}
    parents = torch.tensor([1, 0, 0, 3])  # rows 0 and 1 swap blocks: each is read before either is written
    attention.take_parent_blocks(state, parents, torch.tensor([CACHE_BLOCK + 5]))
    block = slice(CACHE_BLOCK, 2 * CACHE_BLOCK)
    for name, old in before.items():
        assert torch.equal(entry[name][:, :, block], old[parents][:, :, block])
        for other in (slice(0, CACHE_BLOCK), slice(2 * CACHE_BLOCK, capacity)):
            assert torch.equal(entry[name][:, :, other], old[:, :, other])
    # the slot past the last block (a step at the capacity) copies within the capacity, nothing past it
    attention.take_parent_blocks(state, torch.tensor([3, 3, 3, 3]), torch.tensor([capacity]))
    assert torch.equal(entry["key_buffer"][:, :, -1], entry["key_buffer"][3:4, :, -1].expand(4, 2, 4))


def test_the_table_shares_full_blocks_and_keeps_the_writing_block_own():
    model = build(seed=4, max_target_positions=POSITIONS)
    generator = EagerStaticGenerator([model], D, beam_size=2)
    states, graphed = generator.step_model.begin(2, 2, 4 * CACHE_BLOCK, torch.device("cpu"))
    generator.step_model.prefill(torch.full((4, 3), 5), states)  # the caches are allocated
    table = torch.arange(4, dtype=torch.int32).view(-1, 1).repeat(1, 4)
    generator.step_model.use_block_table(states, table)
    # after the step at slot 2 * CACHE_BLOCK - 2 the next write (slot 2 * CACHE_BLOCK - 1) is still in block 1
    generator.step_model.reorder_blocks(states, torch.tensor([1, 1, 2, 2]), torch.tensor([2 * CACHE_BLOCK - 2]))
    assert table.tolist() == [[1, 0, 0, 0], [1, 1, 1, 1], [2, 2, 2, 2], [2, 3, 3, 3]]
    # after the step at slot 2 * CACHE_BLOCK - 1 block 1 is full: shared, the next write starts block 2
    generator.step_model.reorder_blocks(states, torch.tensor([1, 0, 3, 3]), torch.tensor([2 * CACHE_BLOCK - 1]))
    assert table.tolist() == [[1, 1, 0, 0], [1, 0, 1, 1], [2, 3, 2, 2], [2, 3, 3, 3]]
    # sentence 0 leaves the batch: sentence 1's rows move up, their entries follow
    generator.step_model.drop_rows(states, torch.tensor([2, 3]))
    assert table[:2].tolist() == [[0, 1, 0, 0], [0, 1, 1, 1]]
    generator.step_model.use_block_table(states, None)
    assert all(e.get("block_rows") is None for s in states for e in s.values() if "key_buffer" in e)


def test_a_long_prompts_full_blocks_are_read_from_the_sentences_first_row():
    model = build(seed=4, max_target_positions=POSITIONS)
    table, copy = static_generators(model, 3, max_len_b=90)
    first_tables = []
    original = StepModel.reorder_blocks

    def spied(self, states, parents, slot):
        original(self, states, parents, slot)
        if not first_tables:
            first_tables.append(self.block_table.clone())

    table.step_model.reorder_blocks = spied.__get__(table.step_model)
    prompts = [[W[i % 6 + 1] for i in range(CACHE_BLOCK + 10)], [W[2]] * (2 * CACHE_BLOCK + 3)]
    assert_equal_hypotheses(decode(table, prompts), decode(copy, prompts))
    # after the first step (the prompts are fed up to the shorter one's length, 75 tokens): the rows of each
    # sentence read block 0 from its first row (0, 3); each row's later blocks are its own
    first = first_tables[0]
    assert first[:6, 0].tolist() == [0, 0, 0, 3, 3, 3]
    assert first[:6, 1:].tolist() == [[row] * (first.size(1) - 1) for row in range(6)]
