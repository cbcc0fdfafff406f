"""The model contract: what the trainer, the parallelization functions, checkpointing, the memory planner and
the throughput meter may ask of a model, and nothing more. The registry accepts only models deriving from
BaseFairseqModel (upstream's base class name, so plug-ins written for upstream subclass it unchanged).

A model provides:
- `build_model(cfg, task)` (classmethod): the model for a config and a task (dictionaries, max positions);
- `check_config(cfg)` (classmethod): the model's option checks, run by `validate(cfg)` before any work;
- `transformer_layers()`: the nn.ModuleList of repeated blocks. FSDP makes each one unit, activation
  checkpointing and `--compile` wrap each one; the entries may be replaced by wrappers in place;
- `reset_parameters()`: initialize every parameter (a model built on the meta device is allocated, then this
  runs on each rank's shards);
- `max_positions()`: the longest input it accepts (None: no limit);
- `flops_per_token(seq_len)`: training FLOPs (forward + backward) per token, for tflops/mfu (None: unknown);
- `upgrade_state_dict(state_dict, cfg)` (classmethod): an upstream or older state dict under today's names
  (the hook of plug-ins; the built-in transformer_lm's upstream names are fairseq.checkpoint.legacy's table);
- `architecture_options`: config fields that define the function computed; resuming must keep them;
- `describe_config(cfg)` (classmethod, optional): the config's shape in words, for the start-up log line;
- `tensor_parallel_sizes(cfg)` (classmethod) and `tensor_parallel_plan()`: how the model splits over the ranks
  of --model-parallel-size (None: it has no plan and is refused), as data (`TensorParallelPlan`).
Model files hold no distributed or precision code: parallelism is applied to them from outside. A plan names
its styles with strings, which fairseq.distributed.tensor_parallel turns into DTensor styles: models sit below
distributed/ in the import order, and importing torch.distributed.tensor would cost every model import ~1 s.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from fairseq.dataclass.utils import add_dataclass_to_parser
from fairseq.registry import config_name
from fairseq.upstream_absent import absent_name as _absent_name


# The styles a TensorParallelPlan may name (applied by fairseq.distributed.tensor_parallel), N ranks:
TENSOR_PARALLEL_STYLES = {
    "colwise": "a Linear split by output features (columns); its input whole on every rank",
    "colwise_from_sequence": "colwise, its input arriving split along the sequence (gathered first)",
    "rowwise_to_sequence": "a Linear split by input features (rows); its partial sums reduce-scattered along "
    "the sequence",
    "sequence_norm": "a norm on an input split along the sequence (parameters replicated)",
    "gather_sequence": "a module whose first input arrives split along the sequence, gathered whole for it",
    "vocab_embedding": "an Embedding split by rows (the vocabulary), its output summed over the ranks",
    "vocab_output": "an output projection split by the vocabulary: logits kept split for a vocabulary-parallel "
    "loss, gathered otherwise",
    "replicate": "parameters replicated on every rank, computed alike",
}


@dataclass(frozen=True)
class TensorParallelSizes:
    """What a model's config says about splitting it (read by validate(cfg), before anything is built)."""

    heads: int  # --model-parallel-size must divide these (0: nothing to divide)
    ffn: int
    refused: Tuple[str, ...] = ()  # flags set in the config that the plan does not cover


@dataclass(frozen=True)
class TensorParallelPlan:
    """How a built model splits over N ranks. Every parameter must lie in a module the plan names; tied
    parameters stay tied."""

    styles: Dict[str, str]  # module path (from the model) -> a TENSOR_PARALLEL_STYLES name, applied in order
    # (first, last) module paths: the residual stream is split along the sequence from the first one's input
    # to the last one's output (sequence parallelism; padded to a multiple of N in between)
    sequence_parallel: Optional[Tuple[str, str]] = None
    heads: int = 0  # sizes N must divide (0: none), checked when the plan is applied
    ffn: int = 0
    vocab: int = 0
    output_vocab: int = 0
    description: str = ""  # what is split, in words, for the start-up log line


class BaseFairseqModel(nn.Module):
    architecture_options: Tuple[str, ...] = ()

    @classmethod
    def build_model(cls, cfg, task) -> "BaseFairseqModel":
        raise NotImplementedError(f"{cls.__name__} must implement build_model(cfg, task)")

    @classmethod
    def add_args(cls, parser) -> None:
        """Upstream's hook: add this model's flags (its config dataclass's fields, without defaults, so that an
        architecture preset can fill the unset ones) to an argparse parser; plug-ins extend it."""
        dc = getattr(cls, "config_class", None)
        if dc is not None:
            add_dataclass_to_parser(parser, dc, suppress_defaults=True)

    @classmethod
    def check_config(cls, cfg) -> None:
        """Raise ValueError naming the flag for options this model cannot build (run by validate(cfg))."""

    @classmethod
    def describe_config(cls, cfg) -> str:
        """The resolved config's shape in words ("2 layers, embed dim 32, ..."); "" when the model says none."""
        return ""

    @classmethod
    def config_notice(cls, cfg) -> str:
        """A line training logs after the model config line, about what the flags left to defaults built (e.g.
        extra projections); "" for none."""
        return ""

    @classmethod
    def tensor_parallel_sizes(cls, cfg) -> Optional[TensorParallelSizes]:
        """The sizes --model-parallel-size must divide and the options it excludes; None: no plan."""
        return None

    def tensor_parallel_plan(self) -> Optional[TensorParallelPlan]:
        """How this model (as built, before any wrapper) splits over the ranks; None: no plan."""
        return None

    def transformer_layers(self) -> nn.ModuleList:
        raise NotImplementedError(
            f"{type(self).__name__} must implement transformer_layers(): the ModuleList of its repeated blocks, "
            "which FSDP, activation checkpointing and --compile wrap one at a time"
        )

    def reset_parameters(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement reset_parameters()")

    def max_positions(self) -> Optional[int]:
        return None

    def flops_per_token(self, seq_len: int) -> Optional[float]:
        return None

    @classmethod
    def upgrade_state_dict(cls, state_dict: dict, cfg=None) -> dict:
        return state_dict

    def get_normalized_probs(self, net_output, log_probs: bool, sample=None) -> torch.Tensor:
        """Upstream's model API, for criterions written against it: fp32 (log-)probabilities of the logits."""
        logits = net_output[0] if isinstance(net_output, tuple) else net_output
        return F.log_softmax(logits.float(), dim=-1) if log_probs else F.softmax(logits.float(), dim=-1)

    def get_targets(self, sample, net_output) -> torch.Tensor:
        return sample["target"]

    @classmethod
    def from_pretrained(
        cls, model_name_or_path: str, checkpoint_file: str = "model.pt", data_name_or_path: str = ".", **kwargs
    ):
        """Upstream's hub entry point for a local directory: a GeneratorHubInterface (encode / decode / sample /
        score / generate) over the checkpoint(s); see fairseq.hub.hub_utils.from_pretrained."""
        # The one upward import of the model contract (declared in scripts/check_structure.py): upstream's API
        # puts the hub's constructor on the model class; it runs only when called.
        from fairseq.hub import hub_utils  # deferred: upward

        loaded = hub_utils.from_pretrained(model_name_or_path, checkpoint_file, data_name_or_path, **kwargs)
        return hub_utils.GeneratorHubInterface(loaded["args"], loaded["task"], loaded["models"])


def model_config_line(model: nn.Module, cfg) -> str:
    """One log line of the model as built: its --arch, its config's shape and its parameter count."""
    describe = getattr(type(model), "describe_config", None)
    details = describe(cfg) if describe is not None else ""
    params = sum(p.numel() for p in model.parameters())
    return (
        f"model config: --arch {config_name(cfg) or type(model).__name__}"
        + (f", {details}" if details else "")
        + f", {params:,} parameters"
    )


class FairseqLanguageModel(BaseFairseqModel):
    """A decoder-only language model: `model(src_tokens) -> (logits [B, T, V], extra)` (upstream's), its blocks at
    `decoder.layers`."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, src_tokens: torch.Tensor, src_lengths: Optional[torch.Tensor] = None, **kwargs):
        return self.decoder(src_tokens, **kwargs)

    def transformer_layers(self) -> nn.ModuleList:
        return self.decoder.layers

    def max_positions(self) -> Optional[int]:
        return self.decoder.max_positions()

    def reset_parameters(self) -> None:
        self.decoder.reset_parameters()


def __getattr__(name):
    # upstream's FairseqEncoderDecoderModel lives in the compat wing (fairseq.upstream_absent resolves it there)
    return _absent_name(__name__, name)
