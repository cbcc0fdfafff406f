"""EMA.get_model() of an FSDP2-sharded model on 2 real processes (gloo, CPU): the tiny transformer_lm sharded by
parallelize_model (with activation checkpointing, --fsdp-forward-prefetch and --fsdp-sync-free, whose hooks and
wrappers the copy must leave behind) trains 3 SGD updates on each rank's half of a batch; after each update
a one-process model is given the same (gathered) weights and has its own EMA. get_model() then returns, on
every rank, a plain TransformerLanguageModel whose weights and forward are bitwise those of the one-process
EMA's model; a later call refills the same object; its state dict is what upstream saves as
extra_state["ema"] and loads back. Under tensor parallelism get_model() refuses with one clear error.

Exactness: the EMA update is element-wise, so a shard's averaged values are the same fp32 operations on the
same inputs as the whole tensor's (the one-process model is given the FSDP run's weights, not trained
separately); gathering copies. The two models' forwards are the same modules and weights in one process."""

import copy
import functools
from itertools import chain
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.train_fixtures import spawn_scenarios

WORLD = 2
VOCAB, PAD, BATCH, SEQ = 32, 1, 4, 8
DECAY, START = 0.75, 2  # decay 0 (a copy) at update 1, then 0.75


def make_cfg(**distributed):
    from fairseq.dataclass.configs import FairseqConfig

    cfg = FairseqConfig()
    cfg.common.cpu = True
    cfg.distributed_training.ddp_backend = "fully_sharded"
    for name, value in distributed.items():
        setattr(cfg.distributed_training, name, value)
    cfg.model = SimpleNamespace(checkpoint_activations=True, offload_activations=False)
    return cfg


def build_model():
    from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config

    torch.manual_seed(0)
    cfg = preset_config(
        "transformer_lm_gpt3_small",
        decoder_layers=2,
        decoder_embed_dim=16,
        decoder_attention_heads=2,
        dropout=0.0,
        tokens_per_sample=SEQ,
    )
    return TransformerLanguageModel.build(cfg, VOCAB, PAD)


def batch():
    tokens = torch.randint(PAD + 1, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def unequal(a, b):
    """Keys whose tensors differ (or exist on one side only)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def scenario_fsdp(rank):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from fairseq.dataclass.configs import EMAConfig
    from fairseq.distributed.parallelize import parallelize_model
    from fairseq.models.ema import EMA

    out = {}
    model = build_model()
    plain = copy.deepcopy(model)
    model = parallelize_model(model, make_cfg(fsdp_forward_prefetch=True, fsdp_sync_free=True), torch.device("cpu"))
    ema_cfg = EMAConfig(store_ema=True, ema_decay=DECAY, ema_start_update=START)
    ema, ema_plain = EMA(model, ema_cfg), EMA(plain, ema_cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens, targets = batch()
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)

    def update(n):
        optimizer.zero_grad()
        F.cross_entropy(model(tokens[rows])[0].reshape(-1, VOCAB), targets[rows].reshape(-1)).backward()
        optimizer.step()
        plain.load_state_dict({k: full(v) for k, v in model.state_dict().items()})
        ema.step(model, n)
        ema_plain.step(plain, n)

    for n in range(1, 4):
        update(n)
    copied = ema.get_model()
    reference = ema_plain.get_model()
    out["class"] = (type(copied).__name__, type(reference).__name__)
    out["layer_classes"] = [type(layer).__name__ for layer in copied.decoder.layers]
    out["fsdp_or_wrapper"] = [
        name for name, m in copied.named_modules() if isinstance(m, (FSDPModule, ActivationWrapper))
    ]
    out["dtensors"] = [type(t).__name__ for t in chain(copied.parameters(), copied.buffers()) if isinstance(t, DTensor)]
    out["hooks"] = [
        name
        for name, m in copied.named_modules()
        if m._forward_pre_hooks or m._forward_hooks or m._backward_hooks or m._backward_pre_hooks
    ]
    out["requires_grad"] = [name for name, p in copied.named_parameters() if p.requires_grad]
    out["tied"] = copied.decoder.output_projection.weight is copied.decoder.embed_tokens.weight
    out["unequal_at_3"] = unequal(copied.state_dict(), reference.state_dict())
    out["ema_moved"] = not torch.equal(
        reference.state_dict()["decoder.embed_tokens.weight"], plain.state_dict()["decoder.embed_tokens.weight"]
    )
    copied.eval()
    reference.eval()
    with torch.no_grad():
        out["forward_equal"] = torch.equal(copied(tokens)[0], reference(tokens)[0])

    update(4)
    again = ema.get_model()
    out["same_object"] = again is copied
    out["unequal_at_4"] = unequal(again.state_dict(), reference.state_dict())
    # Upstream's checkpoint: extra_state["ema"] = ema.get_model().state_dict(); loaded back into a sharded EMA.
    restored = EMA(model, ema_cfg)
    restored.load_checkpoint_state({"ema": again.state_dict()}, {})
    out["unequal_restored"] = unequal(restored.full_state_dict()["ema"], reference.state_dict())
    return out


def scenario_tensor_parallel(rank):
    from fairseq.dataclass.configs import EMAConfig
    from fairseq.distributed.parallelize import parallelize_model
    from fairseq.models.ema import EMA

    model = parallelize_model(build_model(), make_cfg(model_parallel_size=WORLD), torch.device("cpu"))
    try:
        EMA(model, EMAConfig(store_ema=True)).get_model()
    except RuntimeError as error:
        return str(error)
    return "no error"


SCENARIOS = {"fsdp": scenario_fsdp, "tensor_parallel": scenario_tensor_parallel}  # in this order: TP last


def rank_scenarios(rank):
    return {name: functools.partial(scenario, rank) for name, scenario in SCENARIOS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawn_scenarios(rank_scenarios, tmp_path_factory.mktemp("ema_get_model"), WORLD)


def result(runs, name, rank):
    value = runs[rank][name]
    if isinstance(value, Exception):
        raise value
    return value


@pytest.mark.parametrize("rank", range(WORLD))
def test_get_model_is_a_plain_model_without_fsdp(runs, rank):
    r = result(runs, "fsdp", rank)
    assert r["class"] == ("TransformerLanguageModel", "TransformerLanguageModel")
    assert r["layer_classes"] == ["TransformerDecoderLayer"] * 2  # checkpoint wrappers left behind
    assert r["fsdp_or_wrapper"] == [] and r["dtensors"] == [] and r["hooks"] == []
    assert r["requires_grad"] == [] and r["tied"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_get_model_equals_the_one_process_ema_bitwise(runs, rank):
    r = result(runs, "fsdp", rank)
    assert r["ema_moved"]  # the average is not the weights: the comparison means something
    assert r["unequal_at_3"] == [] and r["forward_equal"]
    assert r["same_object"] and r["unequal_at_4"] == []  # refilled by the later call
    assert r["unequal_restored"] == []


@pytest.mark.parametrize("rank", range(WORLD))
def test_get_model_refuses_tensor_parallel_models(runs, rank):
    message = result(runs, "tensor_parallel", rank)
    assert message.startswith("EMA.get_model(): the model is split by tensor parallelism")
    assert "EMA.full_state_dict()" in message and "EMA.reverse(model)" in message
