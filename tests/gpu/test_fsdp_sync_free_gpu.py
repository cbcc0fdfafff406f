"""--fsdp-sync-free on CUDA: at most two layers hold full (unsharded) parameters on the GPU at any time,
in forward and in backward. Runs on up to 2 GPUs (NCCL, one process each); one GPU gives a world-size-1
FSDP mesh, which still gathers (copies) and frees full parameters per layer.

What is inspected. Each decoder layer's FSDP parameter group (`layer._get_fsdp_state()._fsdp_param_groups`,
FSDP2 internals, test-only) is instrumented: `unshard` logs when an all-gather is really issued (the group
is neither unsharded nor already gathering), and `reshard` records a CUDA event on the current stream
right after the group really freed its full parameters (`is_unsharded` before, `is_sharded` after). A
layer's full parameters exist on the GPU from the all-gather until the GPU has passed that event. At
every all-gather the test counts the layers in that window (their event not recorded yet, or
`query()` false) and keeps the maximum.

The stand-in model sleeps on the GPU in every layer (forward and backward), so the CPU would run far
ahead without the limiter: the same measurement with --fsdp-sync-free off must exceed two, which shows
the measurement can fail. The real TransformerLanguageModel (bf16) is checked with the flag on.
"""

import os
import subprocess
import sys
import traceback
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from fairseq.dataclass.configs import FairseqConfig
from fairseq.runtime.env import get_free_port
from fairseq.distributed.fsdp import FSDPSettings, apply_fsdp, sync_free_limiter, transformer_layers
from fairseq.models import BaseFairseqModel

pytestmark = pytest.mark.gpu

NUM_LAYERS = 8
SLEEP_CYCLES = 20_000_000  # about 10 ms at H100/H200 clocks: far longer than the CPU needs per layer


class _GpuSleep(torch.autograd.Function):
    """Keeps the GPU busy for a while in forward and again in backward, without changing values."""

    @staticmethod
    def forward(ctx, x):
        torch.cuda._sleep(SLEEP_CYCLES)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(SLEEP_CYCLES)
        return grad


class SlowLayer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + _GpuSleep.apply(torch.tanh(self.fc(x)))


class SlowDecoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(SlowLayer(dim) for _ in range(NUM_LAYERS))


class SlowModel(BaseFairseqModel):
    """A model under the contract parallelize_model expects (transformer_layers()), with GPU-bound layers."""

    def __init__(self, dim=256):
        super().__init__()
        self.decoder = SlowDecoder(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        x = self.decoder.embed(x)
        for layer in self.decoder.layers:
            x = layer(x)
        return torch.tanh(self.head(x))  # not a view of Linear's 2-D result (FSDP2 warns about views)

    def transformer_layers(self):
        return self.decoder.layers


def fsdp_param_groups(layer):
    """FSDP2's parameter groups of one sharded module (a list in torch >= 2.12, one group before)."""
    state = layer._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return groups


def real_model():
    from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config

    cfg = preset_config(
        "transformer_lm_gpt3_small",
        decoder_layers=NUM_LAYERS,
        decoder_embed_dim=1024,
        decoder_attention_heads=16,
        dropout=0.0,
        tokens_per_sample=1024,
    )
    return TransformerLanguageModel.build(cfg, 50272, 1)


class AliveCounter:
    def __init__(self):
        self.alive = {}  # layer -> CUDA event recorded when its full parameters were freed (None before)
        self.history = []  # (layer gathered, layers alive at that moment)
        self.max_alive = 0

    def instrument(self, model):
        for index, layer in enumerate(transformer_layers(model)):
            for group in fsdp_param_groups(layer):
                self._wrap(group, index)

    def _wrap(self, group, layer):
        unshard, reshard = group.unshard, group.reshard

        def counted_unshard(*args, **kwargs):
            if group._all_gather_result is None and not group.is_unsharded:
                # Forget layers the GPU is done with; the one being gathered now counts from here on.
                self.alive = {i: e for i, e in self.alive.items() if e is None or not e.query()}
                self.alive[layer] = None
                self.history.append((layer, sorted(self.alive)))
                self.max_alive = max(self.max_alive, len(self.alive))
            return unshard(*args, **kwargs)

        def counted_reshard(*args, **kwargs):
            was_unsharded = group.is_unsharded
            result = reshard(*args, **kwargs)
            if was_unsharded and group.is_sharded:
                event = torch.cuda.Event()
                event.record()
                self.alive[layer] = event
            return result

        group.unshard, group.reshard = counted_unshard, counted_reshard


def run_case(kind, prefetch, mode, device):
    """mode: "off" (no --fsdp-sync-free), "pressure" (the flag, with its allocator probe answering yes, so
    the window is two layers) or "relaxed" (the flag with its own probe, which sees no pressure here)."""
    torch.manual_seed(0)
    cfg = FairseqConfig()
    cfg.distributed_training.ddp_backend = "fully_sharded"
    cfg.distributed_training.fsdp_forward_prefetch = prefetch
    cfg.distributed_training.fsdp_sync_free = mode != "off"
    cfg.model = SimpleNamespace(checkpoint_activations=False, offload_activations=False)
    # The limiter --fsdp-sync-free installs (sync_free_limiter, as apply_fsdp builds it), given to apply_fsdp so
    # that the test can press it and read its counts.
    limiter = (
        None
        if mode == "off"
        else sync_free_limiter(FSDPSettings.from_flags(cfg.distributed_training), NUM_LAYERS, device)
    )
    if mode == "pressure":
        limiter.pressure_probe = lambda: True
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    if kind == "slow":
        model = apply_fsdp(SlowModel(), cfg, mesh, limiter=limiter)
        inputs = torch.randn(8, 64, 256, device=device)
        loss_fn = lambda out: out.float().square().mean()  # noqa: E731
    else:
        cfg.common.bf16 = True
        model = apply_fsdp(real_model(), cfg, mesh, limiter=limiter)
        inputs = torch.randint(2, 50272, (1, 1024), device=device)
        # the model gives (logits, extra)
        loss_fn = lambda out: F.cross_entropy(out[0].float().flatten(0, 1), inputs.view(-1))  # noqa: E731
    counter = AliveCounter()
    counter.instrument(model)
    for _ in range(3):
        loss_fn(model(inputs)).backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return dict(
        max_alive=counter.max_alive,
        history=counter.history,
        limiter_waits=None if limiter is None else limiter.waits,
        pressured_passes=None if limiter is None else limiter.pressured_passes,
    )


CASES = [("slow", p, m) for p in (False, True) for m in ("off", "pressure", "relaxed")] + [
    ("real", p, "pressure") for p in (False, True)
]


def _worker(rank, world, port, out_dir):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
        device_id=device,
    )
    results = {}
    try:
        for case in CASES:
            try:
                results[case] = run_case(*case, device)
            except Exception:
                results[case] = RuntimeError(f"rank {rank}, case {case}:\n{traceback.format_exc()}")
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    world = min(2, torch.cuda.device_count())
    out_dir = str(tmp_path_factory.mktemp("sync_free_gpu"))
    mp.spawn(_worker, args=(world, get_free_port("127.0.0.1"), out_dir), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def case_result(run, case):
    value = run[case]
    if isinstance(value, Exception):
        raise value
    return value


@pytest.mark.parametrize("kind,prefetch", [("slow", False), ("slow", True), ("real", False), ("real", True)])
def test_sync_free_keeps_at_most_two_layers_of_full_parameters(runs, kind, prefetch):
    for run in runs:
        result = case_result(run, (kind, prefetch, "pressure"))
        assert result["limiter_waits"] is True  # CUDA events, not the CPU no-op
        assert result["pressured_passes"] == 3
        # Three steps of forward and backward, every layer gathered in each.
        assert len(result["history"]) == 3 * 2 * NUM_LAYERS
        print(f"{kind} prefetch={prefetch}: max layers alive {result['max_alive']}")
        assert result["max_alive"] <= 2, result["history"]


@pytest.mark.parametrize("prefetch", [False, True])
def test_without_sync_free_the_cpu_runs_ahead_of_a_slow_gpu(runs, prefetch):
    """The control: the same measurement sees more than two layers alive when nothing waits."""
    for run in runs:
        result = case_result(run, ("slow", prefetch, "off"))
        assert result["limiter_waits"] is None
        print(f"slow prefetch={prefetch}, no sync-free: max layers alive {result['max_alive']}")
        assert result["max_alive"] > 2


@pytest.mark.parametrize("prefetch", [False, True])
def test_without_allocator_pressure_sync_free_lets_the_cpu_run_up_to_one_update_ahead(runs, prefetch):
    """The allocator probe sees no pressure on this small model, so the window is one update's all-gathers
    (2 * layers + 2): more than two layers alive on the slow GPU, never more than that window."""
    for run in runs:
        result = case_result(run, ("slow", prefetch, "relaxed"))
        assert result["limiter_waits"] is True and result["pressured_passes"] == 0
        print(f"slow prefetch={prefetch}, sync-free without pressure: max layers alive {result['max_alive']}")
        assert 2 < result["max_alive"] <= 2 * NUM_LAYERS + 2, result["history"]


PROBE_SCRIPT = """
import torch
from fairseq.distributed.sync_free import AllocatorPressure

device = torch.device("cuda", 0)
total = torch.cuda.get_device_properties(device).total_memory
torch.cuda.set_per_process_memory_fraction(0.05, device)  # about 7 GiB of an H200
probe = AllocatorPressure(device)
readings = [probe()]  # nothing reserved yet
block = torch.empty(int(0.97 * probe.capacity) // 4, dtype=torch.float32, device=device)
readings.append(probe())  # reserved at 97% of what this process may use
del block
torch.cuda.empty_cache()
small = [torch.empty(int(0.4 * probe.capacity) // 4, dtype=torch.float32, device=device) for _ in range(2)]
del small  # cached, not returned: the next larger block can only come from freeing the cache and retrying
large = torch.empty(int(0.6 * probe.capacity) // 4, dtype=torch.float32, device=device)
retries = torch.cuda.memory_stats(device)["num_alloc_retries"]
readings.append(probe())  # the retry
del large
torch.cuda.empty_cache()
readings.append(probe())  # no new retry, nothing reserved
print(retries, readings)
"""


def test_allocator_probe_sees_reserved_memory_near_the_limit_and_retries():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", PROBE_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "[False,", "True,", "True,", "False]"], proc.stdout
