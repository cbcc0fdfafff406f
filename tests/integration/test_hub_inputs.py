"""The hub interface's arguments (fairseq.hub.hub_inputs): a wrong type or value is one TypeError or
ValueError naming the method, the argument and what it takes, raised before any decoding, instead of a raw
AttributeError / IndexError from inside or a prompt silently cut at a padding id; and the generation options
the command line refuses in a line (stream's beam, --temperature below the float32 bound, --max-len-b without
room for output) refused here in the keywords' names. On the session's tiny checkpoint."""

import copy
import os

import pytest
import torch

from fairseq.models.transformer_lm import TransformerLanguageModel

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm(tiny_data, tiny_lm_checkpoint):
    return TransformerLanguageModel.from_pretrained(
        os.path.dirname(tiny_lm_checkpoint), "checkpoint_last.pt", data_name_or_path=str(tiny_data)
    )


def test_stream_with_a_beam_is_the_command_lines_refusal(lm):
    """Was a TypeError (beam given twice); fairseq-interactive --stream --beam 2 is a usage line."""
    with pytest.raises(ValueError) as error:
        list(lm.stream("w1 w2", beam=2))
    assert str(error.value) == (
        "stream(): beam=2: streaming needs beam=1 (greedy, or sampling=True); use sample() "
        "or generate() for a beam search"
    )
    assert "".join(lm.stream("w1 w2", beam=1, max_len_b=4)) == lm.sample("w1 w2", beam=1, max_len_b=4)
    with pytest.raises(TypeError, match=r"^stream\(\): sentence must be a string \(one prompt\), got list$"):
        list(lm.stream(["w1 w2"]))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda lm: lm.sample(None), TypeError, "sample(): sentences must be a string or a list of strings, got None"),
        (lambda lm: lm.sample(123), TypeError, "sample(): sentences must be a string or a list of strings, got 123"),
        (lambda lm: lm.sample(["w1", None]), TypeError, "sample(): sentences[1] is None, not a string"),
        (
            lambda lm: lm.score(b"w1 w2"),
            TypeError,
            "score(): sentences must be a string or a list of strings, got a bytes (b'w1 w2')",
        ),
        (
            lambda lm: lm.generate("w1 w2"),
            TypeError,
            "generate(): tokenized_sentences must be a 1-D tensor of ids or a list of them (encode() gives one per "
            "sentence; sample() takes text), got a str ('w1 w2')",
        ),
        (
            lambda lm: lm.generate([[5, 6, 2]]),
            TypeError,
            "generate(): tokenized_sentences[0] is a list ([5, 6, 2]); each prompt is a 1-D tensor of ids (encode() gives "
            "one; encode() a string first)",
        ),
        (
            lambda lm: lm.generate(torch.tensor([5.0, 6.5, 2.0])),
            TypeError,
            "generate(): tokenized_sentences holds torch.float32 values; ids are integers (a LongTensor, as encode() "
            "gives)",
        ),
        (
            lambda lm: lm.generate([torch.tensor([5, 2]), torch.tensor([True, False])]),
            TypeError,
            "generate(): tokenized_sentences[1] holds torch.bool values; ids are integers",
        ),
        (
            lambda lm: lm.generate(torch.zeros(1, 2, 3, dtype=torch.long)),
            TypeError,
            "generate(): tokenized_sentences must be a 1-D tensor of ids or a list of them (encode() gives one per "
            "sentence; sample() takes text), got a 3-D tensor",
        ),
        (
            lambda lm: lm.generate(torch.tensor([5, 5000, 2])),
            ValueError,
            "generate(): tokenized_sentences holds id 5000 at position 1, outside this model's dictionary (ids 0 to 63); "
            "encode() gives ids of this dictionary",
        ),
        (
            lambda lm: lm.generate([torch.tensor([5, 2]), torch.tensor([6, 7, -1])]),
            ValueError,
            "generate(): tokenized_sentences[1] holds id -1 at position 2, outside this model's dictionary",
        ),
        # was silently cut at the <pad>: [5, 1, 6, 2] generated from [5] alone
        (
            lambda lm: lm.generate(torch.tensor([5, 1, 6, 2]), beam=1),
            ValueError,
            "generate(): tokenized_sentences holds the padding id 1 at position 1: a prompt cannot hold <pad> (batches "
            "are padded for you); remove it",
        ),
        (
            lambda lm: lm.generate(torch.tensor([[5, 6, 2], [7, 2, 1]])),
            ValueError,
            "generate(): tokenized_sentences[1] holds the padding id 1 at position 2",
        ),
        (
            lambda lm: lm.generate(lm.encode("w1"), beam=1, sampling=True, seed="abc"),
            TypeError,
            "generate(): seed='abc' must be an integer (the sampling draws' seed) or None (a new one per call)",
        ),
        (
            lambda lm: lm.sample("w1", beam=1, sampling=True, seed=1.5),
            TypeError,
            "generate(): seed=1.5 must be an integer",
        ),
    ],
)
def test_wrong_arguments_are_one_error_naming_them(lm, call, error, message):
    with pytest.raises(error) as raised:
        call(lm)
    assert str(raised.value).startswith(message), str(raised.value)


def test_what_is_accepted_still_works(lm):
    one = lm.generate(lm.encode("w1 w2"), beam=1, max_len_b=4)
    assert isinstance(one, list) and isinstance(one[0], dict)  # one prompt: its hypotheses
    rows = lm.generate(torch.tensor([[5, 6, 2], [7, 8, 2]], dtype=torch.int32), beam=1, max_len_b=4)
    assert len(rows) == 2 and torch.equal(rows[1][0]["tokens"][:2], torch.tensor([7, 8]))
    assert lm.sample(("w1", "w2"), beam=1, max_len_b=3) == lm.sample(["w1", "w2"], beam=1, max_len_b=3)
    assert lm.generate(lm.encode("w1"), beam=1, sampling=True, seed=7, max_len_b=4)[0]["tokens"].numel() > 1


def test_a_temperature_below_what_float32_holds(lm):
    """Was decoded with scores of -8e9: below 1/ln(largest float32) = 0.0113 every token but the likeliest has
    probability 0. The bound follows the dtype the probabilities are computed in (float64: 0.0014)."""
    with pytest.raises(ValueError) as error:
        lm.sample("w1 w2", beam=1, sampling=True, temperature=1e-9)
    assert str(error.value) == (
        "temperature=1e-09 is below 0.0113 (1/ln of 3.403e+38, the largest float32, which the probabilities are "
        "computed in): divided by it, logits one apart give probabilities whose ratio no float32 holds, so every "
        "token but the likeliest gets probability 0 (scores near -1e9); pass at least 0.0113, or beam=1 without "
        "sampling=True for greedy decoding"
    )
    assert lm.sample("w1 w2", beam=1, sampling=True, temperature=0.0114, max_len_b=4)
    wide = copy.deepcopy(lm).double()
    assert wide.sample("w1 w2", beam=1, sampling=True, temperature=0.005, max_len_b=4)
    with pytest.raises(
        ValueError,
        match=r"^temperature=0.001 is below 0.0014 \(1/ln of 1.798e\+308, the largest "
        r"float64, which the probabilities are computed in\)",
    ):
        wide.sample("w1 w2", beam=1, sampling=True, temperature=0.001)


def test_max_len_b_without_room_for_output_names_itself(lm):
    """Was `--min-len 1 is larger than the longest output allowed, -5 tokens`."""
    with pytest.raises(ValueError) as error:
        lm.sample("w1 w2", beam=1, max_len_b=-5)
    assert str(error.value) == (
        "max_len_b=-5 is out of range: outputs have at most max_len_a * input length + "
        "max_len_b tokens (the prompt included), below 0 with max_len_a=0; give max_len_b=0 "
        "or more"
    )
    with pytest.raises(ValueError) as error:  # room for long prompts only: the generator's rule, per batch
        lm.sample("w1 w2", beam=1, max_len_a=0.5, max_len_b=-5)
    assert str(error.value) == (
        "--max-len-b -5 makes the longest output -3 tokens (--max-len-a 0.5 * 3 + "
        "--max-len-b -5), below 0; raise --max-len-b to at least 0"
    )  # 0.5 * 3 + 0: 1 token
    assert lm.sample("w1 w2", beam=1, max_len_a=0.5, max_len_b=0) == "w1"  # the prompt cut to 1 token, as upstream
