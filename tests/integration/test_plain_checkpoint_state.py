"""A checkpoint holds plain data only (fairseq.checkpoint.io.check_plain, run on the exact state written or handed
to the stager): a --user-dir model whose state_dict() holds an enum makes fairseq-train stop at its first save
with one line naming the entry, in either save mode, and no file is written under a checkpoint's name (before,
a synchronous save wrote a checkpoint that weights_only loading refuses, and torch 2.11's stager could not copy
it)."""

import pytest

from tests.train_fixtures import tiny_train_argv, train_in_process, write_plugin

pytestmark = pytest.mark.usefixtures("one_thread")

PLUGIN = """
import enum

from torch import nn

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture


class Mode(enum.IntEnum):
    TRAIN = 1


class ModeTag(nn.Module):
    def get_extra_state(self):
        return Mode.TRAIN

    def set_extra_state(self, state):
        pass


@register_model("enum_state_lm")
class EnumStateLM(TransformerLanguageModel):
    @staticmethod
    def add_args(parser):
        TransformerLanguageModel.add_args(parser)

    @classmethod
    def build_model(cls, args, task):
        model = super().build_model(args, task)
        model.mode_tag = ModeTag()
        return model


@register_model_architecture("enum_state_lm", "enum_state_lm")
def enum_state_lm(args):
    base_lm_architecture(args)
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    directory = tmp_path_factory.mktemp("plugins") / "enum_state_plugin"
    write_plugin(directory, PLUGIN)
    return str(directory)


@pytest.mark.parametrize("mode", [[], ["--write-checkpoints-asynchronously"]], ids=["synchronous", "background"])
def test_a_model_state_holding_an_enum_is_refused_at_the_first_save_naming_it(tiny_data, tmp_path, plugin, mode):
    argv = tiny_train_argv(
        tiny_data, tmp_path, "--user-dir", plugin, "--save-interval-updates", "2", *mode, max_update=3, log_file=False
    )
    argv[argv.index("--arch") + 1] = "enum_state_lm"
    status, out, err = train_in_process(argv)
    assert status == 1, out[-2000:] + err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [
        f"fairseq-train: error: cannot save {tmp_path / 'checkpoint_1_2.pt'}: state.model.mode_tag."
        "_extra_state is of type enum_state_plugin.Mode (<Mode.TRAIN: 1>). A checkpoint holds tensors, "
        "dict/list/tuple and int/float/bool/str/bytes/None only (it loads with weights_only=True): the "
        "state_dict() that returned these entries must return plain values"
    ], err
    assert not any(p.name.startswith("checkpoint") for p in tmp_path.iterdir()), sorted(tmp_path.iterdir())
