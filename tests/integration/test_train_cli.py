"""fairseq-train and fairseq-eval-lm through their real entry points on a tiny model (CPU)."""

import math
import subprocess

import pytest
import torch

from fairseq.data import Dictionary
from fairseq.logging.progress_bar import read_json_log
from fairseq_cli import eval_lm, generate, train
from tests.train_fixtures import assert_same_model_and_optimizer, console_in_process, train_in_process


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_resume_is_bitwise(tiny_data, tmp_path, train_args):
    straight = tmp_path / "straight"
    train.cli_main(train_args(tiny_data, straight, max_update=12))
    resumed = tmp_path / "resumed"
    train.cli_main(train_args(tiny_data, resumed, max_update=7))  # stops mid-epoch
    first = load(resumed / "checkpoint_last.pt")
    assert first["extra_state"]["trainer"]["num_updates"] == 7
    assert first["extra_state"]["train_iterator"]["iterations_in_epoch"] > 0
    train.cli_main(train_args(tiny_data, resumed, max_update=12))

    a, b = load(straight / "checkpoint_last.pt"), load(resumed / "checkpoint_last.pt")
    assert_same_model_and_optimizer(a, b)
    losses_straight = [(r["num_updates"], r["loss"]) for r in read_json_log(straight / "train.log")]
    losses_resumed = [(r["num_updates"], r["loss"]) for r in read_json_log(resumed / "train.log")]
    assert losses_straight == losses_resumed
    assert [u for u, _ in losses_straight] == [str(i) for i in range(1, 13)]


def test_checkpoint_is_plain_and_has_upstream_keys(tiny_data, tmp_path, train_args):
    train.cli_main(train_args(tiny_data, tmp_path, max_update=3))
    state = load(tmp_path / "checkpoint_last.pt")  # weights_only=True: no pickled objects inside
    for key in ("cfg", "model", "criterion", "optimizer_history", "task_state", "extra_state", "last_optimizer_state"):
        assert key in state
    assert state["optimizer_history"][-1]["num_updates"] == 3
    assert state["cfg"]["model"]["_name"] == "transformer_lm"
    assert "decoder.layers.1.self_attn.q_proj.weight" in state["model"]
    assert set(state["extra_state"]) >= {"metrics", "previous_training_time", "train_iterator", "val_loss", "best"}


def test_a_tasks_own_state_is_saved_and_given_back_on_resume(tiny_data, tmp_path, train_args, monkeypatch):
    """task_state holds the task's state_dict() (a plug-in task's curriculum, say), and a resume gives it back."""
    from fairseq.tasks.language_modeling import LanguageModelingTask

    loaded = []
    monkeypatch.setattr(LanguageModelingTask, "state_dict", lambda self: {"stage": 2, "seen": [1, 2]})
    monkeypatch.setattr(LanguageModelingTask, "load_state_dict", lambda self, state: loaded.append(state))
    train.cli_main(train_args(tiny_data, tmp_path, max_update=2))
    assert load(tmp_path / "checkpoint_last.pt")["task_state"] == {"stage": 2, "seen": [1, 2]}
    assert loaded == []  # a fresh start restores nothing
    train.cli_main(train_args(tiny_data, tmp_path, max_update=3))
    assert loaded == [{"stage": 2, "seen": [1, 2]}]


def test_loss_falls_and_eval_lm_matches_independent_computation(tiny_data, tmp_path, train_args):
    train.cli_main(train_args(tiny_data, tmp_path, "--validate-interval-updates", "10", max_update=60))
    rows = read_json_log(tmp_path / "train.log")
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"]) - 1.0

    ckpt = tmp_path / "checkpoint_last.pt"
    result = eval_lm.main(_eval_cfg(tiny_data, ckpt))
    # Independent computation: the same blocks, model loaded by hand, cross entropy in float64.
    from fairseq.checkpoint.inference import load_model
    from fairseq.tasks.language_modeling import LanguageModelingConfig

    task_cfg = LanguageModelingConfig(data=str(tiny_data), tokens_per_sample=32)
    task_cfg._name = "language_modeling"
    loaded = load_model(str(ckpt), task_cfg=task_cfg)
    task, model = loaded.task, loaded.model
    model.eval()
    task.load_dataset("test")
    ds = task.dataset("test")
    pad = task.source_dictionary.pad()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(ds)):
            item = ds[i]
            src, tgt = item["source"].unsqueeze(0), item["target"].unsqueeze(0)
            logp = torch.log_softmax(model(src)[0].double(), -1)
            mask = tgt.ne(pad)
            total -= logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)[mask].sum().item()
            count += int(mask.sum())
    mean_bits = total / count / math.log(2)
    assert result["tokens"] == count
    assert result["loss"] == pytest.approx(mean_bits, rel=1e-6)  # fp32 logits vs float64: 1e-6 relative
    assert result["perplexity"] == pytest.approx(2**mean_bits, rel=1e-5)


def _eval_cfg(data, path, *extra):
    from fairseq import options

    parser = options.get_eval_lm_parser()
    args = options.parse_args_and_arch(
        parser,
        [
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
        ],
    )
    return options.convert_namespace_to_config(args)


def test_eval_lm_context_window_scores_every_token_once(tiny_data, tmp_path, train_args):
    train.cli_main(train_args(tiny_data, tmp_path, max_update=5))
    ckpt = tmp_path / "checkpoint_last.pt"
    plain = eval_lm.main(_eval_cfg(tiny_data, ckpt))
    windowed = eval_lm.main(_eval_cfg(tiny_data, ckpt, "--context-window", "16"))
    assert windowed["tokens"] == plain["tokens"]
    assert windowed["loss"] != plain["loss"]


def test_upstream_wikitext_command_line_runs(tiny_data, tmp_path):
    """FAIRSEQ_COMPAT.md's language-model example, unchanged apart from sizes, --cpu, and no --fp16
    (fp16 needs a GPU; tests/gpu covers it)."""
    argv = [
        "--task",
        "language_modeling",
        str(tiny_data),
        "--save-dir",
        str(tmp_path),
        "--arch",
        "transformer_lm",
        "--share-decoder-input-output-embed",
        "--dropout",
        "0.1",
        "--optimizer",
        "adam",
        "--adam-betas",
        "(0.9, 0.98)",
        "--weight-decay",
        "0.01",
        "--clip-norm",
        "0.0",
        "--lr",
        "0.0005",
        "--lr-scheduler",
        "inverse_sqrt",
        "--warmup-updates",
        "4000",
        "--warmup-init-lr",
        "1e-07",
        "--tokens-per-sample",
        "64",
        "--sample-break-mode",
        "none",
        "--max-tokens",
        "512",
        "--update-freq",
        "2",
        "--max-update",
        "2",
        "--decoder-layers",
        "1",
        "--decoder-embed-dim",
        "64",
        "--decoder-ffn-embed-dim",
        "128",  # size
        "--cpu",
        "--num-workers",
        "0",
    ]
    status, stdout, stderr = train_in_process(argv)
    assert status == 0, stderr
    state = load(tmp_path / "checkpoint_last.pt")
    assert state["extra_state"]["trainer"]["num_updates"] == 2
    # bare transformer_lm keeps upstream's input/output dims of 512: project_in/out, as upstream 0.12.2 builds
    vocab = len(Dictionary.load(str(tiny_data / "dict.txt")))
    assert {k: tuple(v.shape) for k, v in state["model"].items() if "layers" not in k} == {
        "decoder.version": (1,),
        "decoder.embed_tokens.weight": (vocab, 512),
        "decoder.project_in_dim.weight": (64, 512),
        "decoder.embed_positions._float_tensor": (1,),
        "decoder.project_out_dim.weight": (512, 64),
        "decoder.output_projection.weight": (vocab, 512),
    }
    assert (state["cfg"]["model"]["decoder_input_dim"], state["cfg"]["model"]["decoder_output_dim"]) == (512, 512)
    # the resolved model config and the notice of the projections, each logged once
    lines = [line.split(" | ", 3)[3] for line in stdout.splitlines() if "model config:" in line or "dims 512" in line]
    assert lines == [
        "input/output dims 512 (upstream's default) with embed dim 64: adds project_in/out; pass "
        "--decoder-input-dim 64 --decoder-output-dim 64 to drop them",
        "model config: --arch transformer_lm, 1 layers, embed dim 64 (input 512, output 512), ffn 128, "
        "8 heads, sinusoidal positions (64), post-norm, relu, shared input/output embeddings, "
        "131,776 parameters",
    ]


def test_eval_lm_and_generate_log_the_model_config(tiny_data, tiny_lm_checkpoint):
    expected = (
        "model config: --arch transformer_lm, 2 layers, embed dim 32 (input 32, output 32), ffn 64, 2 heads, "
        "sinusoidal positions (32), post-norm, relu, shared input/output embeddings, 19,136 parameters"
    )
    common = [
        str(tiny_data),
        "--path",
        str(tiny_lm_checkpoint),
        "--gen-subset",
        "test",
        "--cpu",
        "--tokens-per-sample",
        "32",
        "--batch-size",
        "4",
        "--num-workers",
        "0",
    ]
    for name, cli_main, extra in (
        ("fairseq-eval-lm", eval_lm.cli_main, []),
        ("fairseq-generate", generate.cli_main, ["--sample-break-mode", "eos"]),
    ):
        status, stdout, stderr = console_in_process(name, cli_main, common + extra)
        assert status == 0, stderr
        assert [line.split(" | ", 3)[3] for line in stdout.splitlines() if "model config:" in line] == [expected]


def _run_train(argv):
    """fairseq-train's console entry point in this process (tests/unit/test_console_script.py runs the
    installed script as a process)."""
    returncode, stdout, stderr = train_in_process(argv)
    return subprocess.CompletedProcess(argv, returncode, stdout, stderr)


def test_missing_dict_is_a_clear_error(tmp_path, train_args):
    (tmp_path / "data").mkdir()
    proc = _run_train(train_args(tmp_path / "data", tmp_path / "ck"))
    assert proc.returncode != 0
    assert "dict.txt" in proc.stderr + proc.stdout


def test_unknown_arch_is_a_usage_error(tiny_data, tmp_path, train_args):
    argv = train_args(tiny_data, tmp_path)
    argv[argv.index("transformer_lm")] = "transformer_lm_nonexistent"
    proc = _run_train(argv)
    assert proc.returncode == 2
    assert "unknown architecture 'transformer_lm_nonexistent'" in proc.stderr


def test_unknown_flag_is_a_usage_error(tiny_data, tmp_path, train_args):
    proc = _run_train(train_args(tiny_data, tmp_path, "--no-such-flag"))
    assert proc.returncode == 2
    assert "--no-such-flag" in proc.stderr


def test_checkpoint_of_another_architecture_is_rejected(tiny_data, tmp_path, train_args):
    train.cli_main(train_args(tiny_data, tmp_path, max_update=1))
    argv = train_args(tiny_data, tmp_path, max_update=2)
    argv[argv.index("--decoder-layers") + 1] = "3"
    with pytest.raises(Exception, match="different architecture"):
        train.cli_main(argv)


def test_resuming_with_another_tying_flag_names_the_fix(tiny_data, tmp_path, train_args):
    train.cli_main(train_args(tiny_data, tmp_path, max_update=1))  # the tiny model ties input and output embeddings
    untied = train_args(tiny_data, tmp_path, max_update=2)
    untied.remove("--share-decoder-input-output-embed")
    with pytest.raises(Exception, match="optimizer state does not fit.*--reset-optimizer"):
        train.cli_main(untied)
    train.cli_main(untied + ["--reset-optimizer"])  # keeps the weights, starts a new optimizer
    assert load(tmp_path / "checkpoint_last.pt")["extra_state"]["trainer"]["num_updates"] == 2


def test_missing_restore_file_is_a_clear_error(tiny_data, tmp_path, train_args):
    with pytest.raises(FileNotFoundError, match="--restore-file"):
        train.cli_main(train_args(tiny_data, tmp_path, "--restore-file", "nope.pt"))


def test_nan_loss_stops_with_a_clear_error(tiny_data, tmp_path, nan_after_two, train_args):
    argv = train_args(
        tiny_data, tmp_path / "ck", "--user-dir", str(nan_after_two), "--criterion", "nan_after_two", max_update=6
    )
    proc = _run_train(argv)
    assert proc.returncode != 0
    assert "loss became nan" in proc.stderr + proc.stdout


def test_the_config_is_validated_once_per_process(tiny_data, tmp_path, train_args, monkeypatch):
    """fairseq-train checks the flags before launching; the rank it launches trusts them (issue 40: the loop used
    to run validate(cfg) again). An in-process caller of main(cfg) still gets them checked, once."""
    from fairseq import options

    calls = []
    real = train.validate_config
    monkeypatch.setattr(train, "validate_config", lambda cfg: calls.append(cfg) or real(cfg))
    train.cli_main(train_args(tiny_data, tmp_path / "cli", max_update=1))
    assert len(calls) == 1
    args = options.parse_args_and_arch(
        options.get_training_parser(), train_args(tiny_data, tmp_path / "in_process", max_update=1)
    )
    train.main(options.convert_namespace_to_config(args))
    assert len(calls) == 2
