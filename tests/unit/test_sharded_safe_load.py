"""Sharded checkpoints (torch.distributed.checkpoint directories) load without unpickling code.

DCP writes the directory index `.metadata` with plain pickle and stores non-tensor values (optimizer
hyperparameters) in the `.distcp` shards with torch.save; DCP's own reader and planner unpickle both without
restriction. A real sharded checkpoint is written by fairseq-train (one process, --use-sharded-state), then
tampered with pickles whose __reduce__ creates a marker file: every load path (load_sharded, the
consolidation function and script, fairseq-eval-lm, fairseq-train --finetune-from-model / --restore-file)
must refuse with a CheckpointError naming the file and the global, without creating the marker; an
untampered checkpoint loads bitwise equal to what DCP's own (trusted) converter reads; with
--trust-legacy-checkpoint the plain pickle path is taken. The command lines run through their console entry
points in this process (tests/train_fixtures.py console_in_process).
"""

import builtins
import importlib.util
import io
import logging
import os
import pickle
import shlex
import shutil
import subprocess

import pytest
import torch

from fairseq.checkpoint import sharded
from fairseq.checkpoint.consolidate import consolidate
from fairseq.checkpoint.io import CheckpointError, CorruptCheckpointError
from tests.train_fixtures import console_in_process

pytestmark = pytest.mark.timeout(600)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def train_argv(build_train_args):
    """One process writing sharded checkpoints: the tiny transformer_lm_gpt, --seed 5, no validation, no json log."""

    def argv(data, save_dir, *extra, max_update=2):
        return build_train_args(
            data,
            save_dir,
            "--disable-validation",
            "--ddp-backend",
            "fully_sharded",
            "--use-sharded-state",
            *extra,
            max_update=max_update,
            arch="transformer_lm_gpt",
            seed="5",
            json_log=False,
            log_file=False,
        )

    return argv


def run(module_or_script, *argv):
    """The command line `python -m MODULE ARGV` (fairseq_cli.train, fairseq_cli.eval_lm) or `python SCRIPT
    ARGV`, through its console entry point in this process (console_in_process); a CompletedProcess."""
    if module_or_script.endswith(".py"):
        spec = importlib.util.spec_from_file_location("script_under_test", module_or_script)
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        name, cli_main = os.path.basename(module_or_script)[: -len(".py")], script.main
    else:
        module = importlib.import_module(module_or_script)
        name, cli_main = "fairseq-" + module_or_script.split(".")[-1].replace("_", "-"), module.cli_main
    status, stdout, stderr = console_in_process(name, cli_main, list(argv))
    return subprocess.CompletedProcess([module_or_script, *argv], status, stdout, stderr)


@pytest.fixture(scope="module")
def pristine(tiny_data, tmp_path_factory, train_argv):
    """(sharded checkpoint directory written by fairseq-train, what DCP's own converter reads from it)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    save_dir = tmp_path_factory.mktemp("sharded")
    proc = run("fairseq_cli.train", *train_argv(tiny_data, save_dir))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = save_dir / "checkpoint_last"
    assert (path / ".metadata").is_file() and (path / sharded.METADATA).is_file()
    reference = save_dir / "reference.pt"
    dcp_to_torch_save(str(path), str(reference))  # our own, untampered file: trusted
    return path, torch.load(reference, map_location="cpu", weights_only=True)


# ----------------------------------------------------------------------------- tampering


class Payload:
    """Unpickling this runs `how` (os.system or builtins.open) to create `marker`."""

    def __init__(self, marker, how):
        self.marker, self.how = str(marker), how

    def __reduce__(self):
        if self.how == "system":
            return os.system, (f"touch {shlex.quote(self.marker)}",)
        return builtins.open, (self.marker, "w")


def forbidden_name(how):
    return f"{os.system.__module__}.system" if how == "system" else f"{builtins.open.__module__}.open"  # io.open


def _read_index(path):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # our own untampered index (the test wrote it): trusted


def _write_index(path, metadata):
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


def tampered_index(src, dst, marker, how):
    """A copy of `src` whose `.metadata` is still a valid index but also holds `Payload` (unpickled by plain
    pickle, it creates `marker` and the load goes on)."""
    shutil.copytree(src, dst)
    metadata = _read_index(dst)
    metadata.tampered = Payload(marker, how)
    _write_index(dst, metadata)
    return dst


def tampered_value(src, dst, marker, how, key="optimizer.param_groups.0.lr"):
    """A copy of `src` with an index of DCP's own classes only, but whose non-tensor value `key` in the shard
    is replaced by a torch.save'd `Payload` (appended to the .distcp file, the index pointing at it)."""
    shutil.copytree(src, dst)
    metadata = _read_index(dst)
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    buf = io.BytesIO()
    torch.save(Payload(marker, how), buf)
    shard = os.path.join(dst, info.relative_path)
    info.offset, info.length = os.path.getsize(shard), len(buf.getvalue())
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    _write_index(dst, metadata)
    return dst


def globals_in(path):
    """The (module, name) globals a pickle file refers to; only for files this test wrote (trusted)."""
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(path, "rb") as f:
        Recorder(f).load()
    return seen


# ----------------------------------------------------------------------------- comparing states


def blank(value):
    """A template for DCP to load into: same keys and tensor shapes, every value overwritten by the load."""
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, -7)
    if isinstance(value, dict):
        return {k: blank(v) for k, v in value.items()}
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return [blank(v) for v in value]
    return "unset"  # a non-tensor leaf: DCP replaces it by the stored value


def assert_bitwise_equal(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list)) for v in a):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}.{i}")
    else:
        assert a == b and type(a) is type(b), (where, a, b)


def load_both(path, reference, trust_legacy=None):
    model, optim = blank(reference["model"]), blank(reference["optimizer"])
    kwargs = {} if trust_legacy is None else {"trust_legacy": trust_legacy}
    state = sharded.load_sharded(str(path), model, optim, **kwargs)
    return state


def assert_refused(err, file, how):
    message = str(err)
    assert str(file) in message, message
    assert forbidden_name(how) in message, message
    assert "--trust-legacy-checkpoint" in message and "trust" in message, message


# ----------------------------------------------------------------------------- load_sharded / consolidate


def test_untampered_checkpoint_loads_bitwise_equal(pristine, tmp_path):
    path, reference = pristine
    state = load_both(path, reference)
    assert_bitwise_equal(state["model"], reference["model"], "model")
    assert_bitwise_equal(state["last_optimizer_state"], reference["optimizer"], "optimizer")
    assert state["optimizer_history"][0]["num_updates"] == 2  # metadata.pt beside the shards

    out = tmp_path / "full.pt"
    consolidate(str(path), str(out))
    full = torch.load(out, map_location="cpu", weights_only=True)
    assert_bitwise_equal(full["model"], reference["model"], "model")
    assert_bitwise_equal(full["last_optimizer_state"], reference["optimizer"], "optimizer")
    assert full["cfg"] == state["cfg"]
    consolidate(str(path), str(out), include_optimizer=False)
    small = torch.load(out, map_location="cpu", weights_only=True)
    assert_bitwise_equal(small["model"], reference["model"], "model")
    assert "last_optimizer_state" not in small


@pytest.mark.parametrize("how", ["system", "open"])
def test_tampered_index_is_refused_by_every_loader(pristine, tmp_path, how):
    path, reference = pristine
    marker = tmp_path / "pwned"
    bad = tampered_index(path, tmp_path / "bad", marker, how)
    with pytest.raises(CheckpointError) as err:
        load_both(bad, reference)
    assert_refused(err.value, bad / ".metadata", how)
    with pytest.raises(CheckpointError) as err:  # model only, as fairseq-eval-lm and --finetune-from-model
        sharded.load_sharded(str(bad), blank(reference["model"]))
    assert_refused(err.value, bad / ".metadata", how)
    with pytest.raises(CheckpointError) as err:
        consolidate(str(bad), str(tmp_path / "out.pt"))
    assert_refused(err.value, bad / ".metadata", how)
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("how", ["system", "open"])
def test_tampered_non_tensor_value_in_a_shard_is_refused(pristine, tmp_path, how):
    path, reference = pristine
    marker = tmp_path / "pwned"
    bad = tampered_value(path, tmp_path / "bad", marker, how)
    shard = bad / _read_index(bad).storage_data[next(iter(_read_index(bad).storage_data))].relative_path
    with pytest.raises(CheckpointError) as err:
        load_both(bad, reference)
    assert_refused(err.value, shard, how)
    assert "optimizer.param_groups.0.lr" in str(err.value)
    with pytest.raises(CheckpointError) as err:
        consolidate(str(bad), str(tmp_path / "out.pt"))
    assert_refused(err.value, shard, how)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_damaged_metadata_file_is_a_corrupt_checkpoint_naming_it(pristine, tmp_path, damage):
    path, reference = pristine
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    meta = bad / sharded.METADATA
    data = meta.read_bytes()
    meta.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    for load in (lambda: load_both(bad, reference), lambda: consolidate(str(bad), str(tmp_path / "out.pt"))):
        with pytest.raises(CorruptCheckpointError) as err:
            load()
        assert str(meta) in str(err.value) and ("empty" if damage == "empty" else "truncated") in str(err.value)
    assert not (tmp_path / "out.pt").exists()


def test_pickled_metadata_file_needs_trust_legacy(pristine, tmp_path):
    path, reference = pristine
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    meta = bad / sharded.METADATA
    state = torch.load(meta, weights_only=True)
    state["extra"] = Exotic()
    torch.save(state, meta)
    with pytest.raises(CheckpointError, match="--trust-legacy-checkpoint") as err:
        load_both(bad, reference)
    assert str(meta) in str(err.value)
    assert isinstance(sharded.read_metadata(str(bad), trust_legacy=True)["extra"], Exotic)


class Exotic:
    """A class torch's weights_only unpickler does not admit."""


def test_trust_legacy_checkpoint_takes_the_plain_pickle_path(pristine, tmp_path, caplog):
    path, reference = pristine
    marker = tmp_path / "trusted"
    bad = tampered_index(path, tmp_path / "bad", marker, "open")
    with caplog.at_level(logging.WARNING):
        state = load_both(bad, reference, trust_legacy=True)
    assert marker.exists()  # plain pickle ran the payload: the path the user asked for
    assert "--trust-legacy-checkpoint" in caplog.text
    assert_bitwise_equal(state["model"], reference["model"], "model")
    assert_bitwise_equal(state["last_optimizer_state"], reference["optimizer"], "optimizer")

    marker.unlink()
    consolidate(str(bad), str(tmp_path / "out.pt"), trust_legacy=True)
    assert marker.exists()
    assert_bitwise_equal(torch.load(tmp_path / "out.pt", weights_only=True)["model"], reference["model"])

    marker2 = tmp_path / "trusted_value"
    bad2 = tampered_value(path, tmp_path / "bad2", marker2, "open")
    load_both(bad2, reference, trust_legacy=True)  # DCP's planner unpickles the value with plain pickle
    assert marker2.exists()


# ----------------------------------------------------------------------------- command lines


def test_consolidation_script_refuses_and_accepts_the_flag(pristine, tmp_path):
    path, reference = pristine
    script = os.path.join(ROOT, "scripts", "consolidate_fsdp_shards.py")
    marker = tmp_path / "pwned"
    bad = tampered_index(path, tmp_path / "bad", marker, "system")
    out = tmp_path / "out.pt"
    proc = run(script, str(bad), str(out))
    assert proc.returncode != 0
    assert_refused(proc.stderr, bad / ".metadata", "system")
    assert "Traceback" not in proc.stderr
    assert not marker.exists() and not out.exists()

    proc = run(script, str(bad), str(out), "--trust-legacy-checkpoint")
    assert proc.returncode == 0, proc.stderr
    assert marker.exists()
    assert_bitwise_equal(torch.load(out, weights_only=True)["model"], reference["model"])


def _eval(data, path, *extra):
    return run(
        "fairseq_cli.eval_lm",
        str(data),
        "--path",
        str(path),
        "--gen-subset",
        "test",
        "--tokens-per-sample",
        "32",
        "--batch-size",
        "4",
        "--cpu",
        *extra,
    )


def _loss(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [text for text in (proc.stdout + proc.stderr).splitlines() if "Perplexity" in text][-1]
    return line.split("Loss (base 2):")[1]


def test_eval_lm_refuses_a_tampered_directory(pristine, tiny_data, tmp_path):
    path, _ = pristine
    marker = tmp_path / "pwned"
    bad = tampered_index(path, tmp_path / "bad", marker, "system")
    proc = _eval(tiny_data, bad)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_refused(proc.stderr, bad / ".metadata", "system")
    assert not marker.exists()

    trusted = _eval(tiny_data, bad, "--trust-legacy-checkpoint")
    assert marker.exists()
    assert _loss(trusted) == _loss(_eval(tiny_data, path))


@pytest.mark.parametrize("flag", ["--finetune-from-model", "--restore-file"])
def test_train_refuses_a_tampered_directory(pristine, tiny_data, tmp_path, flag, train_argv):
    path, _ = pristine
    marker = tmp_path / "pwned"
    bad = tampered_index(path, tmp_path / "bad", marker, "system")
    proc = run("fairseq_cli.train", *train_argv(tiny_data, tmp_path / "run", flag, str(bad), max_update=4))
    assert proc.returncode != 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_refused(proc.stderr, bad / ".metadata", "system")
    assert not marker.exists()


# ----------------------------------------------------------------------------- the restricted unpickler


def _global_pickle(module, name, opcode="STACK_GLOBAL"):
    if opcode == "GLOBAL":  # protocol 0/1 form
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n."
    m, n = module.encode(), name.encode()
    return b"\x80\x04\x8c" + bytes([len(m)]) + m + b"\x8c" + bytes([len(n)]) + n + b"\x93."


@pytest.mark.parametrize(
    "module,name",
    [
        ("posix", "system"),
        ("os", "system"),
        ("builtins", "eval"),
        ("builtins", "exec"),
        ("builtins", "getattr"),
        ("builtins", "open"),
        ("builtins", "__import__"),
        ("torch", "load"),
        ("torch.serialization", "load"),
        ("torch", "Tensor"),
        ("pathlib", "Path.write_text"),
        ("torch.distributed.checkpoint.metadata", "os.system"),
        ("torch.distributed.checkpoint.metadata", "torch"),
        ("torch.distributed.checkpoint.filesystem", "pickle"),
        ("collections", "OrderedDict.fromkeys"),
        ("subprocess", "Popen"),
    ],
)
@pytest.mark.parametrize("opcode", ["STACK_GLOBAL", "GLOBAL"])
def test_unpickler_refuses_globals_outside_dcp_metadata(module, name, opcode):
    from fairseq.checkpoint import safe_dcp

    with pytest.raises(CheckpointError) as err:
        safe_dcp.load_metadata(io.BytesIO(_global_pickle(module, name, opcode)), "some/.metadata")
    assert f"{module}.{name}" in str(err.value) and "some/.metadata" in str(err.value)


def test_unpickler_refuses_persistent_ids_and_garbage():
    from fairseq.checkpoint import safe_dcp

    for data in (b"\x80\x04Pabc\n.", b"\x80\x04\x95", b"", b"not a pickle"):
        with pytest.raises(CheckpointError):
            safe_dcp.load_metadata(io.BytesIO(data), "x/.metadata")
    with pytest.raises(CheckpointError, match="not a torch.distributed.checkpoint index"):
        safe_dcp.load_metadata(io.BytesIO(pickle.dumps({"a": [1, 2.0, None, (3,)]})), "x/.metadata")


def test_unpickler_reads_what_dcp_writes_for_every_dtype_and_value(tmp_path):
    """A direct dcp.save (no process group) of tensors of every dtype DCP can store, non-contiguous and
    channels-last tensors, nested containers and plain values: the safe reader loads it equal."""
    from collections import OrderedDict

    import torch.distributed.checkpoint as dcp

    from fairseq.checkpoint import safe_dcp

    dtypes = [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
    ]
    dtypes += [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "uint16", None)) if d is not None]
    state = {f"t_{str(d).split('.')[-1]}": (torch.arange(12) % 3).reshape(3, 4).to(d) for d in dtypes}
    state["nested"] = {
        "a": torch.randn(2, 3).t(),
        "cl": torch.randn(1, 2, 3, 3).to(memory_format=torch.channels_last),
        "list": [torch.ones(2), {"deep": torch.zeros(1)}],
        "scalar": torch.tensor(3.5),
    }
    state["plain"] = {
        "lr": 0.1,
        "betas": (0.9, 0.98),
        "name": "adam",
        "none": None,
        "flag": True,
        "n": 7,
        "params": ["x.weight", "y.bias"],
        "ordered": OrderedDict(b=1, a=2),
        "big": 2**70,
    }
    path = tmp_path / "ckpt"
    dcp.save(state, checkpoint_id=str(path))
    globals_seen = globals_in(path / ".metadata")
    assert globals_seen <= set(safe_dcp.allowed_globals()), globals_seen - set(safe_dcp.allowed_globals())

    target = blank(state)
    dcp.load(target, storage_reader=safe_dcp.SafeFileSystemReader(str(path)))
    assert_bitwise_equal(target, state)
    assert (
        safe_dcp.read_dcp_metadata(str(path)).state_dict_metadata.keys()
        == dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.keys()
    )


def test_real_training_checkpoint_needs_only_the_admitted_globals(pristine):
    from fairseq.checkpoint import safe_dcp

    path, _ = pristine
    seen = globals_in(path / ".metadata")
    assert seen <= set(safe_dcp.allowed_globals()), seen - set(safe_dcp.allowed_globals())
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in seen
    plain = safe_dcp.dcp.FileSystemReader(str(path)).read_metadata()
    safe = safe_dcp.read_dcp_metadata(str(path))
    assert safe.state_dict_metadata == plain.state_dict_metadata
    assert safe.storage_data == plain.storage_data and safe.planner_data == plain.planner_data
    assert safe.storage_meta.load_id is not None  # as DCP's reader sets it
