"""Upstream's task surface that this fork's own commands never call: `LegacyFairseqTask` (tasks configured by an
argparse namespace) with the upstream hooks nothing in the trainer, loop or CLI asks for. `from fairseq.tasks
import LegacyFairseqTask` (and `fairseq.tasks.fairseq_task.LegacyFairseqTask`) resolve here through
fairseq.upstream_absent."""

import os

from fairseq.data.dictionary import Dictionary
from fairseq.dataclass.flag_values import task_data_dir
from fairseq.tasks.fairseq_task import FairseqTask


class LegacyFairseqTask(FairseqTask):
    """Upstream's base of tasks configured by an argparse namespace: flags come from the `add_args(parser)`
    staticmethod, and `args` (also `cfg`) is the whole parsed namespace."""

    def __init__(self, args, **kwargs):
        super().__init__(args)
        self.args = args

    @classmethod
    def setup_task(cls, args, **kwargs) -> "LegacyFairseqTask":
        return cls(args, **kwargs)

    @classmethod
    def build_dictionary(
        cls, filenames, workers: int = 1, threshold: int = -1, nwords: int = -1, padding_factor: int = 8
    ) -> Dictionary:
        """Upstream's hook: a dictionary counted over the words of text files, finalized (fairseq-preprocess
        counts through fairseq.preprocessing.binarizer instead)."""
        d = Dictionary()
        for filename in filenames:
            Dictionary.add_file_to_dictionary(filename, d, num_workers=workers)
        d.finalize(threshold=threshold, nwords=nwords, padding_factor=padding_factor)
        return d

    def has_sharded_data(self, split: str) -> bool:
        """Whether DATA names several directories (`path1:path2`), so each epoch loads a different one."""
        return os.pathsep in (task_data_dir(self.args) or "")

    def logging_outputs_can_be_summed(self, criterion) -> bool:
        return criterion.logging_outputs_can_be_summed()

    def build_model(self, args, from_checkpoint: bool = False):
        return super().build_model(args, from_checkpoint)

    def build_criterion(self, args, optimization_cfg=None):
        return super().build_criterion(args, optimization_cfg)
