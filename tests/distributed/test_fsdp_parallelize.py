"""parallelize_model on real torch.distributed: 2 processes, gloo, CPU, FSDP2 (`fully_shard`) and DDP,
compared with one process training the same model on the same global batch.

All two-process scenarios run in one spawn (starting processes costs far more than the scenarios); each
rank saves what it measured and the tests below compare. A scenario that raises on a rank is reported
by the tests that read it, with the traceback.

Tolerances. Everything is fp32. The distributed run computes the same sums in another order: each rank's
loss is a mean over its half of the batch, the gradient is the average of the two halves' gradients
(reduce-scatter, or DDP's all-reduce, then a division by the world size), and SGD applies it. The
relative rounding error of such a reordering is a few fp32 ulps (1.2e-7) times the depth of the sums,
well inside rtol 1e-5; atol 1e-6 covers gradient elements that are near zero, whose relative error is
meaningless. The four prefetch / sync-free combinations change when all-gathers are issued, not what is
computed (an all-gather copies), so their losses must be bitwise equal.
"""

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.train_fixtures import spawn_ranks, spawn_scenarios
from fairseq.dataclass.configs import FairseqConfig
from fairseq.distributed.fsdp import apply_fsdp, check_fsdp_flags, transformer_layers
from fairseq.distributed.sync_free import ReshardEventLimiter
from fairseq.distributed.parallelize import (
    apply_activation_checkpointing,
    apply_compile,
    clip_grad_norm_,
    materialize,
    parallelize_model,
)
from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config

WORLD = 2
VOCAB, PAD = 32, 1
BATCH, SEQ = 4, 8  # global batch: each rank trains on BATCH // WORLD rows
NUM_LAYERS = 4
STEPS = 3
LR = 0.5
RTOL, ATOL = 1e-5, 1e-6
CKPT = "_checkpoint_wrapped_module."


def fsdp_param_groups(layer):
    """FSDP2's parameter groups of one sharded module (a list in torch >= 2.12, one group before)."""
    state = layer._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return groups


def build_model(meta=False):
    torch.manual_seed(0)
    cfg = preset_config(
        "transformer_lm_gpt3_small",
        decoder_layers=NUM_LAYERS,
        decoder_embed_dim=16,
        decoder_attention_heads=2,
        dropout=0.0,
        tokens_per_sample=SEQ,
    )
    if meta:
        with torch.device("meta"):
            return TransformerLanguageModel.build(cfg, VOCAB, PAD)
    return TransformerLanguageModel.build(cfg, VOCAB, PAD)


def global_batch():
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(PAD + 1, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_cfg(backend="fully_sharded", checkpoint=False, offload=False, **distributed):
    cfg = FairseqConfig()
    cfg.distributed_training.ddp_backend = backend
    for name, value in distributed.items():
        setattr(cfg.distributed_training, name, value)
    cfg.model = SimpleNamespace(checkpoint_activations=checkpoint, offload_activations=offload)
    return cfg


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def named_full(model, what):
    out = {}
    for name, param in model.named_parameters():
        tensor = param if what == "param" else param.grad
        out[name.replace(CKPT, "").replace("module.", "", 1 if name.startswith("module.") else 0)] = (
            full(tensor).detach().float().cpu().clone()
        )
    return out


def train(model, tokens, targets, steps=STEPS, optimizer="sgd", world=1):
    """Mean cross-entropy over the given rows; returns losses averaged over ranks, the first step's
    gradients and the final parameters, all gathered to full tensors."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR) if optimizer == "sgd" else torch.optim.AdamW(params, lr=1e-2)
    losses, first_grads = [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        logits = model(tokens)[0]
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        if step == 0:
            first_grads = named_full(model, "grad")
        opt.step()
        reported = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reported)
            reported /= world
        losses.append(reported)
    return torch.stack(losses), first_grads, named_full(model, "param")


# ---------------------------------------------------------------------------------- 2-process scenarios


def local_batch(rank):
    tokens, targets = global_batch()
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    return tokens[rows], targets[rows]


def scenario_fsdp(rank):
    model = parallelize_model(build_model(), make_cfg(), torch.device("cpu"))
    return train(model, *local_batch(rank), world=WORLD)


def scenario_ddp(rank):
    model = parallelize_model(build_model(), make_cfg("pytorch_ddp"), torch.device("cpu"))
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    return train(model, *local_batch(rank), world=WORLD)


def scenario_flag_combinations(rank):
    losses = {}
    for prefetch in (False, True):
        for sync_free in (False, True):
            cfg = make_cfg(fsdp_forward_prefetch=prefetch, fsdp_sync_free=sync_free)
            model = parallelize_model(build_model(), cfg, torch.device("cpu"))
            losses[(prefetch, sync_free)] = train(model, *local_batch(rank), optimizer="adamw", world=WORLD)[0]
    return losses


def scenario_variants(rank):
    """Options that must not change the arithmetic, each against the single-process reference."""
    variants = {
        "checkpoint": make_cfg(checkpoint=True),
        "checkpoint+offload": make_cfg(checkpoint=True, offload=True),
        "offload_implies_checkpoint": make_cfg(offload=True),
        "no_reshard_after_forward": make_cfg(no_reshard_after_forward=True),
        "cpu_offload": make_cfg(cpu_offload=True),
        "prefetch_depth_2+sync_free": make_cfg(fsdp_forward_prefetch=True, fsdp_prefetch_depth=2, fsdp_sync_free=True),
    }
    out = {}
    for name, cfg in variants.items():
        model = parallelize_model(build_model(), cfg, torch.device("cpu"))
        out[name] = train(model, *local_batch(rank), world=WORLD)
    # Compiled layers (the eager backend: tracing through FSDP's parameter swaps, no code generation).
    model = build_model()
    apply_compile(model, backend="eager")
    apply_fsdp(model, make_cfg(), _mesh())
    out["compile_eager"] = train(model, *local_batch(rank), world=WORLD)
    return out


def scenario_bf16(rank):
    cfg = make_cfg()
    cfg.common.bf16 = True
    model = parallelize_model(build_model(), cfg, torch.device("cpu"))
    logits_dtype = model(local_batch(rank)[0])[0].dtype
    losses = train(model, *local_batch(rank), world=WORLD)[0]
    model(local_batch(rank)[0])[0].float().sum().backward()
    grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
    param_dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return dict(losses=losses, logits_dtype=str(logits_dtype), grad_dtypes=grad_dtypes, param_dtypes=param_dtypes)


def scenario_gradients(rank):
    """clip_grad_norm_ on sharded (FSDP) and replicated (DDP) gradients."""
    out = {}
    tokens, targets = local_batch(rank)
    for backend in ("fully_sharded", "pytorch_ddp"):
        model = parallelize_model(build_model(), make_cfg(backend), torch.device("cpu"))
        F.cross_entropy(model(tokens)[0].float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
        params = list(model.parameters())
        before = named_full(model, "grad")
        norm_only = clip_grad_norm_(params, 0.0)
        unchanged = all(torch.equal(before[k], v) for k, v in named_full(model, "grad").items())
        norm = clip_grad_norm_(params, 0.25)
        out[backend] = dict(norm_only=norm_only, norm=norm, unchanged=unchanged, clipped=named_full(model, "grad"))
    return out


def scenario_meta_init(rank):
    cfg = make_cfg(fsdp_forward_prefetch=True)
    model = parallelize_model(build_model(meta=True), cfg, torch.device("cpu"))
    tied = model.decoder.output_projection.weight is model.decoder.embed_tokens.weight
    on_meta = any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers())
    losses = train(model, *local_batch(rank), world=WORLD)[0]
    return dict(tied=tied, on_meta=on_meta, losses=losses)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,))


class _LoggedEvent:
    """A stand-in CUDA event that logs when it is recorded and waited on."""

    def __init__(self, log):
        self.log = log

    def record(self):
        self.log.append(("record", id(self)))

    def synchronize(self):
        self.log.append(("wait", id(self)))


def scenario_wait_order(rank):
    """Where the hooks act, against what FSDP2 really does. Each layer's FSDP parameter group is
    instrumented (test-only; FSDPParamGroup.unshard/reshard and its is_unsharded / is_sharded /
    _all_gather_result are FSDP2 internals) to log when an all-gather is really issued and when full
    parameters are really freed; stand-in events log when the limiter records and waits."""
    results = {}
    for prefetch in (False, True):
        log = []
        limiter = ReshardEventLimiter(2, lambda: _LoggedEvent(log))
        original_before, original_on = limiter.before_unshard, limiter.on_reshard
        limiter.before_unshard = lambda layer: (log.append(("announce", layer)), original_before(layer))[1]
        limiter.on_reshard = lambda layer: (log.append(("on_reshard", layer)), original_on(layer))[1]
        model = build_model()
        apply_fsdp(model, make_cfg(fsdp_forward_prefetch=prefetch, fsdp_sync_free=True), _mesh(), limiter=limiter)
        for index, layer in enumerate(transformer_layers(model)):
            for group in fsdp_param_groups(layer):
                _instrument(group, index, log)
        tokens, targets = local_batch(rank)
        for _ in range(2):
            F.cross_entropy(model(tokens)[0].float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
        results[prefetch] = log
    return results


def _instrument(group, layer, log):
    unshard, reshard = group.unshard, group.reshard

    def logged_unshard(*args, **kwargs):
        if group._all_gather_result is None and not group.is_unsharded:
            log.append(("issue", layer))
        return unshard(*args, **kwargs)

    def logged_reshard(*args, **kwargs):
        was_unsharded = group.is_unsharded
        result = reshard(*args, **kwargs)
        if was_unsharded and group.is_sharded:
            log.append(("freed", layer))
        return result

    group.unshard, group.reshard = logged_unshard, logged_reshard


SCENARIOS = {
    "fsdp": scenario_fsdp,
    "ddp": scenario_ddp,
    "flags": scenario_flag_combinations,
    "variants": scenario_variants,
    "bf16": scenario_bf16,
    "gradients": scenario_gradients,
    "meta": scenario_meta_init,
    "wait_order": scenario_wait_order,
}


def rank_scenarios(rank):
    return {name: functools.partial(scenario, rank) for name, scenario in SCENARIOS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawn_scenarios(rank_scenarios, tmp_path_factory.mktemp("fsdp_runs"), WORLD)


def result(runs, name, rank=0):
    value = runs[rank][name]
    if isinstance(value, Exception):
        raise value
    return value


@pytest.fixture(scope="module")
def reference():
    """One process, the whole global batch, no parallelization."""
    return train(build_model(), *global_batch())


def assert_same_training(run, reference):
    losses, grads, params = run
    ref_losses, ref_grads, ref_params = reference
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=ATOL)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=RTOL, atol=ATOL, msg=name)
        torch.testing.assert_close(params[name], ref_params[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("engine", ["fsdp", "ddp"])
def test_two_processes_match_one_process_on_the_same_global_batch(runs, reference, engine, rank):
    assert_same_training(result(runs, engine, rank), reference)


def test_training_actually_moves(reference):
    losses, _, _ = reference
    assert losses[-1] < losses[0]  # so that matching it is not trivially matching a constant


@pytest.mark.parametrize(
    "variant",
    [
        "checkpoint",
        "checkpoint+offload",
        "offload_implies_checkpoint",
        "no_reshard_after_forward",
        "cpu_offload",
        "prefetch_depth_2+sync_free",
        "compile_eager",
    ],
)
def test_options_that_must_not_change_the_arithmetic(runs, reference, variant):
    assert_same_training(result(runs, "variants")[variant], reference)


def test_prefetch_and_sync_free_combinations_give_identical_losses(runs):
    for rank in range(WORLD):
        losses = result(runs, "flags", rank)
        baseline = losses[(False, False)]
        assert len(baseline) == STEPS and baseline[-1] < baseline[0]
        for combination, combination_losses in losses.items():
            assert torch.equal(combination_losses, baseline), combination


def test_bf16_parameters_with_fp32_gradients(runs, reference):
    run = result(runs, "bf16")
    assert run["logits_dtype"] == "torch.bfloat16"
    assert run["param_dtypes"] == ["torch.float32"] and run["grad_dtypes"] == ["torch.float32"]
    # Before any update, bf16 (8 bits of mantissa, relative error 4e-3 per rounding) moves the loss by a
    # few 1e-2 at most; later steps apply different gradients at a large learning rate, so they only
    # have to keep training.
    torch.testing.assert_close(run["losses"][0], reference[0][0], rtol=0, atol=5e-2)
    assert run["losses"][-1] < run["losses"][0]


@pytest.mark.parametrize("backend", ["fully_sharded", "pytorch_ddp"])
def test_clip_grad_norm_over_sharded_gradients_equals_the_unsharded_norm(runs, backend):
    model = build_model()
    tokens, targets = global_batch()
    F.cross_entropy(model(tokens)[0].float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    expected = {name: p.grad for name, p in model.named_parameters()}
    assert expected_norm > 0.25  # the clip really scales
    for rank in range(WORLD):
        run = result(runs, "gradients", rank)[backend]
        torch.testing.assert_close(run["norm_only"], expected_norm, rtol=RTOL, atol=0)
        torch.testing.assert_close(run["norm"], expected_norm, rtol=RTOL, atol=0)
        assert run["unchanged"], "max_norm 0 must only compute the norm"
        for name, grad in expected.items():
            torch.testing.assert_close(run["clipped"][name], grad, rtol=RTOL, atol=ATOL, msg=name)


def test_meta_built_model_is_materialized_after_sharding(runs):
    for rank in range(WORLD):
        run = result(runs, "meta", rank)
        assert run["tied"] and not run["on_meta"]
        assert torch.isfinite(run["losses"]).all() and run["losses"][-1] < run["losses"][0]


@pytest.mark.parametrize("prefetch", [False, True])
def test_sync_free_waits_before_fsdp_issues_each_all_gather(runs, prefetch):
    for rank in range(WORLD):
        log = result(runs, "wait_order", rank)[prefetch]
        check_wait_order(log)


def check_wait_order(log):
    """Every all-gather FSDP really issued was announced to the limiter first; the limiter's event for a
    layer was recorded after FSDP really freed it; before all-gather k (k >= 2) the CPU had waited on
    the event of all-gather k-2's freeing, so at most two layers' full parameters were alive."""
    issued = []  # layer of each all-gather, in order
    freed_event = {}  # all-gather index -> event id recorded when it was freed
    current = {}  # layer -> index of its all-gather not yet freed
    announced, freed_unrecorded = set(), set()
    waited = []  # event ids waited on, in order
    record_order = []
    for kind, value in log:
        if kind == "announce":
            announced.add(value)
        elif kind == "issue":
            assert value in announced, f"FSDP gathered layer {value} before the limiter was told"
            announced.discard(value)
            k = len(issued)
            issued.append(value)
            current[value] = k
            if k >= 2:
                target = freed_event.get(k - 2)
                assert target is not None, f"all-gather {k - 2} (layer {issued[k - 2]}) was not freed in time"
                # Waiting on a later-recorded event covers it (one stream completes in order).
                position = record_order.index(target)
                assert any(record_order.index(w) >= position for w in waited), (
                    f"all-gather {k} (layer {value}) issued without waiting for all-gather {k - 2}'s freeing"
                )
        elif kind == "freed":
            freed_unrecorded.add(value)
        elif kind == "on_reshard":
            pending_layer = value
        elif kind == "record":
            assert pending_layer in freed_unrecorded, f"event for layer {pending_layer} recorded before FSDP freed it"
            freed_unrecorded.discard(pending_layer)
            freed_event[current.pop(pending_layer)] = value
            record_order.append(value)
        elif kind == "wait":
            waited.append(value)
    # Two steps of forward and backward: every layer gathered twice per step.
    assert len(issued) == 2 * 2 * NUM_LAYERS
    assert len(waited) == len(issued) - 2


# ---------------------------------------------------------------------------------- single process


def test_fsdp_only_flags_need_fully_sharded():
    for flag, field in [
        ("--fsdp-forward-prefetch", "fsdp_forward_prefetch"),
        ("--fsdp-sync-free", "fsdp_sync_free"),
        ("--cpu-offload", "cpu_offload"),
    ]:
        for backend in ("pytorch_ddp", "c10d", "legacy_ddp"):
            with pytest.raises(ValueError, match=f"{flag} needs --ddp-backend fully_sharded"):
                check_fsdp_flags(backend, **{field: True})
        check_fsdp_flags("fully_sharded", **{field: True})
    with pytest.raises(ValueError, match="--fsdp-prefetch-depth must be at least 1"):
        check_fsdp_flags("fully_sharded", fsdp_forward_prefetch=True, fsdp_prefetch_depth=0)
    # parallelize_model trusts its input: validate(cfg) ran these checks once, in the process that started the
    # job (tests/unit/test_validate.py)


def test_single_process_without_fully_sharded_keeps_the_model():
    assert not dist.is_initialized()
    model = build_model()
    layers = list(model.decoder.layers)
    assert parallelize_model(model, make_cfg("pytorch_ddp"), torch.device("cpu")) is model
    assert list(model.decoder.layers) == layers


def test_activation_checkpointing_keeps_names_values_and_gradients():
    tokens, targets = global_batch()
    plain, checkpointed = build_model(), build_model()
    keys = list(plain.state_dict())
    parallelize_model(checkpointed, make_cfg("pytorch_ddp", checkpoint=True), torch.device("cpu"))
    assert all(type(layer).__name__ == "CheckpointWrapper" for layer in checkpointed.decoder.layers)
    assert list(checkpointed.state_dict()) == keys
    for model in (plain, checkpointed):
        F.cross_entropy(model(tokens)[0].reshape(-1, VOCAB), targets.reshape(-1)).backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_activation_checkpointing(checkpointed)


def test_compile_keeps_parameter_names_and_outputs():
    tokens, _ = global_batch()
    plain, compiled = build_model(), build_model()
    apply_compile(compiled, backend="eager")
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in plain.named_parameters()]
    torch.testing.assert_close(compiled(tokens)[0], plain(tokens)[0], rtol=0, atol=0)


def test_materialize_a_meta_model():
    model = build_model(meta=True)
    assert all(p.is_meta for p in model.parameters())
    torch.manual_seed(5)
    materialize(model, torch.device("cpu"))
    assert not any(p.is_meta for p in model.parameters())
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight
    assert torch.isfinite(model(global_batch()[0])[0]).all()
    assert materialize(model, torch.device("cpu")) is model  # nothing left on meta: untouched


def _single_process_fsdp(rank, port, out_path):
    # No process group: parallelize_model creates a one-rank group itself.
    assert not dist.is_initialized()
    model = parallelize_model(
        build_model(), make_cfg(fsdp_sync_free=True, fsdp_forward_prefetch=True), torch.device("cpu")
    )
    torch.save(train(model, *global_batch()), out_path)


def test_fully_sharded_on_one_process(tmp_path, reference):
    out_path = str(tmp_path / "single.pt")
    spawn_ranks(_single_process_fsdp, 1, 0, out_path)
    assert_same_training(torch.load(out_path, weights_only=False), reference)
