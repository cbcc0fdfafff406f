"""Dropout under tensor parallelism (fairseq/distributed/tensor_parallel_rng.py): per-TP-rank streams inside the
decoder layers, the shared stream outside, on 2 CPU processes (gloo, fp32, the tiny model of
test_tensor_parallel.py with --dropout, --attention-dropout and --activation-dropout 0.1 and learned positions,
TP 2, two micro-batches per update; about 25 s).

One spawn of 2 ranks runs every scenario in sequence; each rank saves what it measured and the tests compare:

- the model split by its plan, one forward and backward on the same tokens, with and without the streams:
  the zero pattern of the activation dropout's output (fc2's input: this rank's FFN columns) is the same on
  both ranks without them (the correlation the streams remove) and different with them; the embedding
  dropout's (replicated) is the same on both ranks either way; under activation checkpointing the recomputed
  masks are the forward's and the gradients are bitwise those without checkpointing.
- the real Trainer, 20 updates on TP 2 x FSDP 1 and on TP 2 alone (pytorch_ddp): every parameter replicated
  over the TP group is bitwise the same on both ranks at the end (the shared stream advanced identically:
  a post-hook that does not give the shared stream back fails this and the resume test), and the split
  masks differ between the ranks (they do not if parallelize_model leaves the streams out); with
  --checkpoint-activations the losses and the model and Adam state are bitwise those without.
- fairseq-train's main (in process) with --use-sharded-state to 6 updates, saving at 3, and a run resumed
  from the update-3 checkpoint: the same logged losses and bitwise the same model and optimizer state at 6
  (nothing about the streams is saved: they are derived from --seed and the update count).
"""

from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.test_tensor_parallel import CHECKPOINTS, _copy_checkpoint, config, run_main, start_training
from tests.train_fixtures import spawn_scenarios

pytestmark = pytest.mark.timeout(300)

WORLD = 2
UPDATES = 20
# Learned positions: a replicated parameter whose gradient each rank computes alone from the embedding dropout's
# mask (not reduced over the TP group, unlike the norms' and biases'), so it drifts apart if the shared stream
# does. Two micro-batches per update: a stream left behind by the first one's layers would reach the second
# one's embedding dropout.
DROPOUT = [
    "--dropout",
    "0.1",
    "--attention-dropout",
    "0.1",
    "--activation-dropout",
    "0.1",
    "--decoder-learned-pos",
    "--update-freq",
    "2",
]
TP2_FSDP1 = ["--ddp-backend", "fully_sharded", "--model-parallel-size", "2", *DROPOUT]
TP2_ALONE = ["--ddp-backend", "pytorch_ddp", "--model-parallel-size", "2", *DROPOUT]
LOG = ["--log-format", "json", "--log-interval", "1"]


def capture_masks(model):
    """Record the zero pattern of the embedding dropout's output (layer 0's input, whole: seen before the
    sequence is split) and of each layer's activation dropout (fc2's input, this rank's FFN columns), at every
    call (a checkpointed layer's fc2 runs again in backward). Returns ({place: [patterns]}, hook handles)."""
    from fairseq.distributed.fsdp import transformer_layers

    seen = defaultdict(list)

    def keep(place):
        return lambda module, args: seen[place].append((args[0] == 0).clone())

    # prepend: before the plan's own input hooks (the sequence split, the DTensor conversion)
    handles = [transformer_layers(model)[0].register_forward_pre_hook(keep("embedding"), prepend=True)]
    fc2s = [module for name, module in model.named_modules() if name.endswith(".fc2")]
    handles += [fc2.register_forward_pre_hook(keep(f"activation{i}"), prepend=True) for i, fc2 in enumerate(fc2s)]
    return seen, handles


def split_model_step(data, streams, checkpointed=False):
    """The model split over TP 2 by its plan (optionally checkpointed, optionally with the streams), one forward
    and backward in training mode on fixed tokens: (masks, loss, this rank's local gradients)."""
    from fairseq import registry
    from fairseq.distributed.mesh import ParallelLayout, init_parallel_mesh
    from fairseq.distributed.parallelize import apply_activation_checkpointing
    from fairseq.distributed.tensor_parallel import apply_tensor_parallel
    from fairseq.distributed.tensor_parallel_rng import apply_dropout_streams

    cfg = config(data, *TP2_FSDP1)
    torch.manual_seed(cfg.common.seed)
    task = registry.TASK_REGISTRY.get(cfg.task._name).setup_task(cfg.task)
    model = task.build_model(cfg.model).train()
    tp_mesh = init_parallel_mesh(ParallelLayout.from_config(cfg.distributed_training, WORLD), "cpu").tp_mesh
    apply_tensor_parallel(model, tp_mesh, loss_parallel=False)
    if checkpointed:
        apply_activation_checkpointing(model)
    if streams:
        apply_dropout_streams(model, tp_mesh)
    masks, _ = capture_masks(model)
    tokens = torch.randint(4, len(task.dictionary), (4, 33))  # the same on both ranks (seeded above)
    logits, _ = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    # parameter names without the checkpoint wrapper's part, which the state dict leaves out too
    return (
        dict(masks),
        loss.detach(),
        {name.replace("._checkpoint_wrapped_module", ""): p.grad.to_local() for name, p in model.named_parameters()},
    )


def replicated_parameters(model):
    """{name: this rank's tensor} of the parameters replicated over the TP group (DTensor Replicate on the mesh's
    tp dimension: norms, row-parallel biases, learned positions)."""
    kept = {}
    for name, param in model.named_parameters():
        tp_dim = param.device_mesh.mesh_dim_names.index("tp")
        if param.placements[tp_dim].is_replicate():
            kept[name] = param.to_local().detach().clone()
    return kept


def train_with_dropout(data, *flags):
    """UPDATES updates through the real Trainer: {losses, masks of the first update, replicated parameters
    (this rank's), full model and optimizer state (rank 0)}."""
    trainer, update = start_training(data, *flags)
    masks, handles = capture_masks(trainer.model)
    losses = [update()]
    for handle in handles:
        handle.remove()
    losses += [update() for _ in range(UPDATES - 1)]
    model_state, optim_state = trainer.model_and_optimizer_state(full=True)
    return {
        "losses": losses,
        "masks": dict(masks),
        "replicated": replicated_parameters(trainer.model),
        "model": {k: v.detach().clone() for k, v in model_state.items()},
        "optimizer": optim_state,
    }


def scenarios(rank, data, out):  # the same scenarios on every rank
    resume = [*CHECKPOINTS, *LOG]
    return {
        "one_stream": lambda: split_model_step(data, streams=False),
        "rank_streams": lambda: split_model_step(data, streams=True),
        "rank_streams_checkpointed": lambda: split_model_step(data, streams=True, checkpointed=True),
        "tp2_fsdp1": lambda: train_with_dropout(data, *TP2_FSDP1),
        "tp2_fsdp1_checkpointed": lambda: train_with_dropout(data, *TP2_FSDP1, "--checkpoint-activations"),
        "tp2_alone": lambda: train_with_dropout(data, *TP2_ALONE),
        "uninterrupted": lambda: run_main(
            data,
            out / "uninterrupted",
            *TP2_FSDP1,
            *resume,
            "--max-update",
            "6",
            "--save-interval-updates",
            "3",
            "--log-file",
            str(out / "uninterrupted.log"),
        ),
        "copy_of_3": lambda: _copy_checkpoint(
            out / "uninterrupted" / "checkpoint_1_3", out / "resumed" / "checkpoint_last"
        ),
        "resumed": lambda: run_main(
            data, out / "resumed", *TP2_FSDP1, *resume, "--max-update", "6", "--log-file", str(out / "resumed.log")
        ),
    }


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_dropout_runs")
    return out, spawn_scenarios(scenarios, out, WORLD, tiny_data, out, timeout_s=120)


def result(runs, name, rank=0):
    value = runs[1][rank][name]
    if isinstance(value, Exception):
        raise value
    return value


def both_ranks(runs, name):
    return result(runs, name, 0), result(runs, name, 1)


# ------------------------------------------------------------------------------- masks of one step


def test_one_stream_gives_both_ranks_the_same_split_masks(runs):
    """Without the streams (the code before them): rank 0's FFN columns and rank 1's are dropped in the same
    pattern; this is what the other tests show gone."""
    (masks0, _, _), (masks1, _, _) = both_ranks(runs, "one_stream")
    for place in ("embedding", "activation0", "activation1"):
        assert torch.equal(masks0[place][0], masks1[place][0]), place


def test_rank_streams_split_masks_differ_and_shared_masks_agree(runs):
    (masks0, _, _), (masks1, _, _) = both_ranks(runs, "rank_streams")
    one_stream = result(runs, "one_stream")[0]
    assert torch.equal(masks0["embedding"][0], masks1["embedding"][0])
    # the shared stream is untouched before the first layer: the embedding mask is the one-stream run's
    assert torch.equal(masks0["embedding"][0], one_stream["embedding"][0])
    for place in ("activation0", "activation1"):
        mask0, mask1 = masks0[place][0], masks1[place][0]
        assert mask0.shape == mask1.shape == (4, 32, 32)  # [batch, tokens, ffn / 2]
        assert not torch.equal(mask0, mask1), place
        for mask in (mask0, mask1):  # dropout at 0.1: 4096 draws, 410 +- 19 expected
            assert 330 < int(mask.sum()) < 490, (place, int(mask.sum()))
    assert not torch.equal(masks0["activation0"][0], masks0["activation1"][0])  # a new stream per layer


def test_checkpointed_recompute_draws_the_forward_masks(runs):
    for rank in range(WORLD):
        plain_masks, plain_loss, plain_grads = result(runs, "rank_streams", rank)
        masks, loss, grads = result(runs, "rank_streams_checkpointed", rank)
        for place in ("activation0", "activation1"):
            forward, recomputed = masks[place]  # fc2 ran in forward and again in backward
            assert torch.equal(forward, recomputed) and torch.equal(forward, plain_masks[place][0]), place
        assert torch.equal(loss, plain_loss)
        assert grads.keys() == plain_grads.keys()
        for name in grads:
            assert torch.equal(grads[name], plain_grads[name]), (rank, name)


# ------------------------------------------------------------------------------- the real Trainer


@pytest.mark.parametrize("layout", ["tp2_fsdp1", "tp2_alone"])
def test_replicated_parameters_stay_bitwise_identical(runs, layout):
    run0, run1 = both_ranks(runs, layout)
    assert run0["losses"] == run1["losses"] and len(run0["losses"]) == UPDATES
    assert run0["replicated"].keys() == run1["replicated"].keys()
    assert {
        "decoder.embed_positions.weight",
        "decoder.layers.0.fc2.bias",
        "decoder.layers.1.self_attn_layer_norm.weight",
    } <= run0["replicated"].keys()
    for name, value in run0["replicated"].items():
        assert torch.equal(value, run1["replicated"][name]), name
    # The trainer's model runs the streams: in both micro-batches of the first update, the split masks differ
    # between the ranks and the shared ones agree.
    for micro_batch in range(2):
        assert torch.equal(run0["masks"]["embedding"][micro_batch], run1["masks"]["embedding"][micro_batch])
        assert not torch.equal(run0["masks"]["activation0"][micro_batch], run1["masks"]["activation0"][micro_batch])


def test_checkpoint_activations_trains_bitwise_as_without(runs):
    plain, checkpointed = result(runs, "tp2_fsdp1"), result(runs, "tp2_fsdp1_checkpointed")
    assert checkpointed["losses"] == plain["losses"]
    assert checkpointed["model"].keys() == plain["model"].keys()
    for name, value in checkpointed["model"].items():
        assert torch.equal(value, plain["model"][name]), name
    for name, state in checkpointed["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, plain["optimizer"]["state"][name][key]), (name, key)


# ------------------------------------------------------------------------------- resume


def logged_losses(path):
    """{update: (loss, gradient norm)} as the log prints them (3 decimals)."""
    from fairseq.logging.progress_bar import read_json_log

    return {int(row["num_updates"]): (row["loss"], row["gnorm"]) for row in read_json_log(path)}


def test_resume_draws_the_uninterrupted_masks(runs):
    from fairseq.checkpoint.consolidate import read_full_state

    for name in ("uninterrupted", "copy_of_3", "resumed"):
        result(runs, name)
    out = runs[0]
    uninterrupted, resumed = logged_losses(out / "uninterrupted.log"), logged_losses(out / "resumed.log")
    assert sorted(resumed) == [4, 5, 6]
    assert resumed == {update: uninterrupted[update] for update in (4, 5, 6)}
    # Any other mask in updates 4-6 would change the weights and Adam's moments: compared bitwise.
    want = read_full_state(str(out / "uninterrupted" / "checkpoint_last"))
    got = read_full_state(str(out / "resumed" / "checkpoint_last"))
    flat_want, flat_got = _tensors(want), _tensors(got)
    assert flat_got.keys() == flat_want.keys() and any(k.startswith("model.") for k in flat_got)
    for key, value in flat_got.items():
        assert torch.equal(value, flat_want[key]), key


def _tensors(state, prefix=""):
    found = {}
    for key, value in state.items():
        if isinstance(value, dict):
            found.update(_tensors(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            found[f"{prefix}{key}"] = value
    return found
