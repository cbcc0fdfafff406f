"""scripts/import_hf.py and scripts/export_hf.py never delete what they did not write.

--overwrite replaces only a directory the same script wrote before (its fairseq_manifest.json lists the files, and
the directory holds nothing else); an output that is an input, holds one or lies inside one is refused whatever
the flags; a non-empty directory without the script's manifest is refused without suggesting --overwrite. Each
refusal is one line, and every file is still there, byte for byte. A failed write names the script's own output
argument (OUT_DIR / OUTPUT), not fairseq-train's --save-dir.
"""

import json
import os
import subprocess

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from fairseq.export import hf, hf_import  # noqa: E402
from fairseq.utils import run_console_script  # noqa: E402
from tests.integration.test_export_hf import word_dictionary, write_checkpoint  # noqa: E402

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")


def _script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_script", os.path.join(SCRIPTS, f"{name}.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def files(root):
    """{relative path: bytes} of every file under `root`."""
    out = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def refused(name, argv, capsys):
    """The one error line of scripts/NAME.py ARGV (exit status 1)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_console_script(name, _script(name).main, [str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1 and len(err) == 1 and err[0].startswith(f"{name}: error: "), err
    return err[0]


@pytest.fixture
def exported(tmp_path):
    """(checkpoint directory, transformers directory): a tiny checkpoint and its export, with a file of the
    user's beside each."""
    ckpt = write_checkpoint(tmp_path / "ck", word_dictionary(), arch="transformer_lm_gpt")
    (tmp_path / "ck" / "checkpoint_last.pt").write_bytes((tmp_path / "ck" / "checkpoint_best.pt").read_bytes())
    hf.export(ckpt, str(tmp_path / "hf"))
    (tmp_path / "notes.txt").write_text("the user's own file\n")
    return tmp_path / "ck", tmp_path / "hf"


def test_import_onto_its_input_or_a_parent_of_it_is_refused(exported, tmp_path, capsys):
    _, source = exported
    before = files(tmp_path)
    for output, where in ((source, "is the input"), (tmp_path, "holds the input")):
        message = refused("import_hf", [source, output, "--overwrite"], capsys)
        assert f"output {output} {where} {source}" in message and "--overwrite" not in message, message
        assert files(tmp_path) == before
    inside = source / "imported"
    message = refused("import_hf", [source, inside], capsys)
    assert f"output {inside} is inside the input {source}" in message
    assert files(tmp_path) == before and not inside.exists()


def test_export_into_the_checkpoint_directory_is_refused(exported, tmp_path, capsys):
    checkpoints, _ = exported
    before = files(tmp_path)
    ckpt = checkpoints / "checkpoint_best.pt"
    message = refused("export_hf", [ckpt, checkpoints, "--overwrite"], capsys)
    assert message == (
        f"export_hf: error: output {checkpoints} holds the input {ckpt}: writing it would replace "
        "what is read; choose an output apart from the inputs"
    )
    # a --dict inside the output, and the dict.txt found beside the checkpoint, count as inputs too
    other = tmp_path / "other"
    other.mkdir()
    (other / "dict.txt").write_bytes((checkpoints / "dict.txt").read_bytes())
    before = files(tmp_path)
    assert f"output {other} holds the input {other / 'dict.txt'}" in refused(
        "export_hf", [ckpt, other, "--dict", other / "dict.txt", "--overwrite"], capsys
    )
    assert files(tmp_path) == before


def test_a_directory_the_script_did_not_write_is_never_replaced(exported, tmp_path, capsys):
    checkpoints, source = exported
    ckpt = checkpoints / "checkpoint_best.pt"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.bin").write_bytes(b"\x00\x01")
    before = files(tmp_path)
    for name, argv in (("export_hf", [ckpt, mine]), ("import_hf", [source, mine])):
        for overwrite in ([], ["--overwrite"]):
            message = refused(name, argv + overwrite, capsys)
            assert message == (
                f"{name}: error: output {mine} already exists and holds files scripts/{name}.py did "
                f"not write (it has no fairseq_manifest.json of {name}); choose a new or empty "
                "directory"
            ), message
    # the export's directory is no import's earlier output (and the other way round)
    imported = tmp_path / "imported"
    hf_import.import_hf(str(source), str(imported))
    before = files(tmp_path)
    assert "scripts/export_hf.py did not write" in refused("export_hf", [ckpt, imported, "--overwrite"], capsys)
    a_file = tmp_path / "notes.txt"
    assert "exists and is not a directory" in refused("export_hf", [ckpt, a_file, "--overwrite"], capsys)
    assert files(tmp_path) == before


def test_overwrite_replaces_an_earlier_output_and_nothing_else(exported, tmp_path, capsys):
    checkpoints, source = exported
    ckpt = checkpoints / "checkpoint_best.pt"
    manifest = json.loads((source / "fairseq_manifest.json").read_text())
    assert manifest == {"written_by": "export_hf", "files": sorted(set(os.listdir(source)) - {"fairseq_manifest.json"})}
    message = refused("export_hf", [ckpt, source], capsys)
    assert message.endswith(
        f"output {source} holds an earlier output of scripts/export_hf.py; pass --overwrite to "
        "replace it, or choose another output"
    )
    run_console_script(
        "export_hf", _script("export_hf").main, [str(ckpt), str(source), "--overwrite", "--model-type", "opt"]
    )
    assert json.loads((source / "config.json").read_text())["model_type"] == "opt"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".hf.")]  # nothing left beside it

    (source / "my_notes.md").write_text("mine")
    before = files(tmp_path)
    message = refused("export_hf", [ckpt, source, "--overwrite"], capsys)
    assert message == (
        f"export_hf: error: output {source} holds my_notes.md, which scripts/export_hf.py did not "
        "write (its fairseq_manifest.json lists what it wrote); move it out or choose another output"
    )
    assert files(tmp_path) == before

    imported = tmp_path / "imported"
    run_console_script("import_hf", _script("import_hf").main, [str(checkpoints.parent / "hf"), str(imported)])
    (source / "my_notes.md").unlink()
    run_console_script("import_hf", _script("import_hf").main, [str(source), str(imported), "--overwrite"])
    assert sorted(os.listdir(imported)) == [
        "checkpoint_best.pt",
        "dict.txt",
        "fairseq_manifest.json",
        "model_flags.txt",
    ]


def test_a_failed_import_write_names_out_dir_not_save_dir(exported, tmp_path, capsys):
    """A file-size limit (EFBIG) while the checkpoint is written, and OUT_DIR under a file (EEXIST): one line naming
    OUT_DIR (not a hidden temporary, not --save-dir) and the errno; the earlier import there is kept."""
    import resource

    _, source = exported
    out = tmp_path / "imported"
    hf_import.import_hf(str(source), str(out))
    before = files(out)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))  # below checkpoint_best.pt's size (Python ignores
    try:  # SIGXFSZ: the write fails with EFBIG)
        message = refused("import_hf", [source, out, "--overwrite"], capsys)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert message.startswith(f"import_hf: error: cannot write the import {out}: File too large (EFBIG). Fix: ")
    blocked = tmp_path / "notes.txt" / "imported"
    assert refused("import_hf", [source, blocked], capsys) == (
        f"import_hf: error: cannot write the import {blocked}: File exists (EEXIST). Fix: a file is where the "
        "directory should be: choose another OUT_DIR"
    )
    assert files(out) == before and sorted(os.listdir(tmp_path)) == ["ck", "hf", "imported", "notes.txt"]


def test_a_full_disk_during_the_import_names_out_dir(exported, tmp_path, capsys):
    """ENOSPC for real: a 256 KiB tmpfs (where this process may mount one) holds the dictionary but not the
    checkpoint."""
    _, source = exported
    mount = tmp_path / "small"
    mount.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True, timeout=30
        ).returncode
        != 0
    ):
        pytest.skip("mounting a tmpfs needs privileges this process lacks")
    try:
        with open(mount / "filler", "wb") as f:  # leave ~64 KiB: more than dict.txt, less than the checkpoint
            f.write(b"\0" * (192 * 1024))
        out = mount / "imported"
        assert refused("import_hf", [source, out], capsys) == (
            f"import_hf: error: cannot write the import {out}: No space left on device (ENOSPC). Fix: free space "
            "on that file system or point OUT_DIR at another one"
        )
        assert os.listdir(mount) == ["filler"]
    finally:
        subprocess.run(["umount", str(mount)], timeout=30)
