"""--retain-dropout (fairseq-generate, fairseq-interactive, task.build_generator): dropout stays on while
generating, on the session's tiny model (trained with --dropout 0.1)."""

import argparse

import pytest
import torch

from fairseq.models.transformer_lm import TransformerLanguageModel

pytestmark = pytest.mark.usefixtures("one_thread")


def scores(task, model, retain_dropout, seed):
    generator = task.build_generator(
        [model], argparse.Namespace(beam=1, max_len_b=6, retain_dropout=retain_dropout, no_cuda_graphs=True)
    )
    d = task.source_dictionary
    tokens = torch.tensor([[d.index("w1"), d.index("w2"), d.index("w3")]])
    sample = {"net_input": {"src_tokens": tokens, "src_lengths": torch.tensor([3])}}
    torch.manual_seed(seed)
    with torch.no_grad():
        hypo = generator.generate([model], sample, prefix_tokens=tokens)[0][0]
    return model.training, hypo["positional_scores"]


def test_retain_dropout_keeps_dropout_on_and_its_absence_turns_it_off(tiny_lm_checkpoint, tiny_data):
    hub = TransformerLanguageModel.from_pretrained(
        str(tiny_lm_checkpoint.parent), tiny_lm_checkpoint.name, data_name_or_path=str(tiny_data)
    )
    task, model = hub.task, hub.models[0]
    training, first = scores(task, model, retain_dropout=True, seed=1)
    _, second = scores(task, model, retain_dropout=True, seed=2)
    assert training is True
    assert not torch.equal(first, second)  # different dropout masks
    training, first = scores(task, model, retain_dropout=False, seed=1)
    _, second = scores(task, model, retain_dropout=False, seed=2)
    assert training is False
    assert torch.equal(first, second)
