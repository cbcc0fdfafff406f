"""Importing fairseq's entry points, building their parsers (which import every built-in task, model,
criterion and optimizer to list the choices) and checking a training config must not import
torch.distributed's checkpoint, tensor or fsdp packages, nor torch._dynamo: together they cost seconds, which
every fairseq process would pay before reading a flag (docs/testing.md). The modules that need them import
them where they are used, and DTensors are recognized through fairseq.runtime.dtensor.

Checked in a fresh interpreter, against what `import torch` itself loads (which is not fairseq's doing).
"""

import json
import subprocess
import sys
from pathlib import Path

import torch

from fairseq.runtime.dtensor import is_dtensor

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo")

# The child records, for each heavy package, the fairseq line whose import first loaded it (the message of a
# failure then names the line to make lazy).
CHILD = r"""
import json, sys, traceback
HEAVY = %r
import torch
loaded_by_torch = [h for h in HEAVY if h in sys.modules]
culprit = {}

class Recorder:
    def find_spec(self, name, path=None, target=None):
        for h in HEAVY:
            if (name == h or name.startswith(h + ".")) and h not in culprit:
                frames = [f for f in traceback.extract_stack() if "/fairseq" in f.filename and "site-packages" not in f.filename]
                culprit[h] = " <- ".join(f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(frames))
        return None

sys.meta_path.insert(0, Recorder())
import fairseq
import fairseq_cli.train, fairseq_cli.eval_lm, fairseq_cli.validate, fairseq_cli.generate
import fairseq_cli.interactive, fairseq_cli.preprocess, fairseq_cli.serve
from fairseq import checkpoint_utils, options
from fairseq.hub import hub_utils
for build in (options.get_training_parser, options.get_eval_lm_parser, options.get_validation_parser,
              options.get_generation_parser, options.get_interactive_generation_parser, options.get_serve_parser):
    build()
# A fairseq-train that stops at a user error after validate(cfg) (no dict.txt): no optimizer is built, which
# would import torch._dynamo (torch.optim does, and it loads the rest), so nothing heavy is needed.
import tempfile
data = tempfile.mkdtemp()
try:
    fairseq_cli.train.cli_main(["--task", "language_modeling", data, "--arch", "transformer_lm", "--optimizer",
                                "adam", "--max-tokens", "64", "--tokens-per-sample", "64", "--cpu", "--save-dir",
                                data + "/checkpoints"])
except FileNotFoundError as err:
    assert "no dict.txt" in str(err), err
print(json.dumps({"loaded_by_torch": loaded_by_torch,
                  "loaded_by_fairseq": {h: culprit.get(h, "?") for h in HEAVY if h in sys.modules and h not in loaded_by_torch}}))
"""


def test_entry_points_parsers_and_validate_import_no_distributed_tensor_checkpoint_fsdp_or_dynamo():
    proc = subprocess.run(
        [sys.executable, "-c", CHILD % (HEAVY,)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded_by_torch"] == []  # else this torch imports them itself and the test proves nothing
    assert result["loaded_by_fairseq"] == {}, "imported at start-up (make these imports lazy): " + "; ".join(
        f"{name} by {chain}" for name, chain in result["loaded_by_fairseq"].items()
    )


def test_is_dtensor_recognizes_dtensors_and_nothing_else():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    assert not is_dtensor(torch.zeros(2))
    assert not is_dtensor(torch.nn.Parameter(torch.zeros(2)))
    assert not is_dtensor(None)
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:  # a DTensor lives on a device mesh, which needs a process group: one gloo rank, in memory
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        value = DTensor.from_local(torch.ones(2), mesh, [Replicate()], run_check=False)
        assert is_dtensor(value)
        assert is_dtensor(torch.nn.Parameter(value))
    finally:
        if created:
            dist.destroy_process_group()
