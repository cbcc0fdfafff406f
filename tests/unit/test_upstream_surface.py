"""Upstream fairseq's module layout and helpers (issue 15): the names code written for upstream imports, with
upstream's documented behaviour; upstream names absent on purpose raise an ImportError that says so."""

import argparse
import copy
import importlib
import os

import pytest
import torch

from fairseq import options, utils


# ------------------------------------------------------------------------------------------ layout


@pytest.mark.parametrize(
    "module, names",
    [
        ("fairseq.file_io", ["PathManager"]),
        ("fairseq.tokenizer", ["tokenize_line"]),
        ("fairseq.preprocessing.file_chunker_utils", ["Chunker", "find_offsets"]),
        (
            "fairseq.preprocessing.binarizer",
            ["BinarizeSummary", "FileBinarizer", "VocabularyDatasetBinarizer", "Binarizer"],
        ),
        (
            "fairseq.data",
            [
                "Dictionary",
                "FairseqDataset",
                "BaseWrapperDataset",
                "ListDataset",
                "TokenBlockDataset",
                "MonolingualDataset",
                "ConcatDataset",
                "ResamplingDataset",
                "TruncatedDictionary",
                "data_utils",
                "iterators",
            ],
        ),
        (
            "fairseq.data.iterators",
            ["EpochBatchIterator", "ShardedIterator", "BufferedIterator", "CountingIterator", "GroupedIterator"],
        ),
        ("fairseq.data.data_utils", ["collate_tokens", "batch_by_size", "numpy_seed", "load_indexed_dataset"]),
        (
            "fairseq.utils",
            [
                "make_positions",
                "resolve_max_positions",
                "strip_pad",
                "move_to_cuda",
                "set_torch_seed",
                "log_softmax",
                "softmax",
                "clip_grad_norm_",
                "convert_padding_direction",
                "item",
                "get_perplexity",
                "import_user_module",
            ],
        ),
        (
            "fairseq.models",
            [
                "BaseFairseqModel",
                "FairseqLanguageModel",
                "FairseqDecoder",
                "FairseqIncrementalDecoder",
                "register_model",
                "register_model_architecture",
                "build_model",
            ],
        ),
        ("fairseq.tasks", ["FairseqTask", "LegacyFairseqTask", "register_task", "setup_task"]),
        ("fairseq.models.ema", ["EMA"]),
        ("fairseq.modules.checkpoint_activations", ["checkpoint_wrapper"]),
        ("fairseq.optim.fp16_optimizer", ["FP16Optimizer", "MemoryEfficientFP16Optimizer", "DynamicLossScaler"]),
        ("fairseq.dataclass.utils", ["convert_namespace_to_omegaconf", "gen_parser_from_dataclass"]),
        ("fairseq.distributed.utils", ["call_main"]),
        ("fairseq.distributed_utils", ["call_main", "get_rank"]),
        (
            "fairseq.options",
            ["get_training_parser", "get_validation_parser", "get_eval_lm_parser", "parse_args_and_arch"],
        ),
        ("fairseq.checkpoint_utils", ["torch_persistent_save", "load_ema_from_checkpoint"]),
        ("fairseq_cli.validate", ["main", "cli_main"]),
    ],
)
def test_upstream_names_import(module, names):
    mod = importlib.import_module(module)
    for name in names:
        assert hasattr(mod, name), f"{module}.{name}"


def test_fork_classes_derive_from_upstream_bases():
    from fairseq.data import FairseqDataset, MonolingualDataset, TokenBlockDataset
    from fairseq.models import FairseqLanguageModel
    from fairseq.models.transformer_lm import TransformerLanguageModel
    from fairseq.tasks import FairseqTask, LegacyFairseqTask
    from fairseq.tasks.language_modeling import LanguageModelingTask

    assert issubclass(TokenBlockDataset, FairseqDataset) and issubclass(MonolingualDataset, FairseqDataset)
    assert issubclass(TransformerLanguageModel, FairseqLanguageModel)
    assert issubclass(LanguageModelingTask, FairseqTask) and issubclass(LegacyFairseqTask, FairseqTask)
    import fairseq.distributed.utils as dist_utils
    from fairseq import distributed_utils

    assert distributed_utils is dist_utils  # upstream's old module name is the same module


@pytest.mark.parametrize(
    "statement, names",
    [
        ("import fairseq.tasks.translation", ["fairseq.tasks.translation", "--task language_modeling"]),
        (
            "from fairseq.models.transformer import TransformerModel",
            ["fairseq.models.transformer", "TransformerLanguageModel"],
        ),
        ("from fairseq.data import BacktranslationDataset", ["fairseq.data.BacktranslationDataset", "translation"]),
        ("from fairseq.models import FairseqEncoderModel", ["FairseqEncoderModel", "encoder"]),
        ("from fairseq.models.roberta import RobertaModel", ["fairseq.models.roberta", "masked"]),
        ("import fairseq.tasks.speech_to_text", ["speech"]),
        ("from fairseq.model_parallel.megatron_trainer import MegatronTrainer", ["fully_sharded"]),
        ("from fairseq.utils import xla_device_to_cpu", ["TPU"]),
    ],
)
def test_absent_upstream_names_raise_an_import_error_that_explains(statement, names):
    with pytest.raises(ImportError) as e:
        exec(statement, {})
    message = str(e.value)
    assert "is not part of this fairseq fork" in message
    for name in names:
        assert name in message


def test_other_missing_names_stay_attribute_errors():
    import fairseq.data
    import fairseq.models

    assert not hasattr(fairseq.data, "NoSuchDataset") and not hasattr(fairseq.models, "NoSuchModel")
    with pytest.raises(ModuleNotFoundError, match="No module named 'fairseq.no_such_module'"):
        importlib.import_module("fairseq.no_such_module")


# ------------------------------------------------------------------------------------------ utils


def test_convert_padding_direction_moves_pads_across():
    left = torch.tensor([[2, 3, 4, 5, 6], [1, 7, 8, 9, 10], [1, 1, 1, 11, 12]])
    right = torch.tensor([[2, 3, 4, 5, 6], [7, 8, 9, 10, 1], [11, 12, 1, 1, 1]])
    assert torch.equal(utils.convert_padding_direction(left, 1, left_to_right=True), right)
    assert torch.equal(utils.convert_padding_direction(right, 1, right_to_left=True), left)
    assert utils.convert_padding_direction(right, 1, left_to_right=True) is right  # already right-padded


def test_make_positions_count_from_padding_idx_plus_one():
    tokens = torch.tensor([[9, 9, 9, 9, 9], [1, 9, 9, 9, 9], [9, 9, 1, 1, 1]])
    assert utils.make_positions(tokens, 1).tolist() == [[2, 3, 4, 5, 6], [1, 2, 3, 4, 5], [2, 3, 1, 1, 1]]


def test_clip_grad_norm_returns_the_norm_and_clips():
    frozen = torch.nn.Parameter(torch.zeros(5)).requires_grad_(False)
    norm = utils.clip_grad_norm_(frozen, 1.0)
    assert torch.is_tensor(norm) and norm.item() == 0.0
    params = [torch.nn.Parameter(torch.zeros(5)) for _ in range(3)]
    for p in params:
        p.grad = torch.full((5,), 2.0)
    assert utils.clip_grad_norm_(params, 1.0).item() == pytest.approx(60**0.5, rel=1e-6)  # sqrt(15 * 2^2)
    assert utils.clip_grad_norm_(params, 1.0).item() == pytest.approx(1.0, abs=1e-5)  # clipped by the first call
    doubled = utils.clip_grad_norm_(params, 0.0, aggregate_norm_fn=lambda n: 2 * n)
    assert doubled.item() == pytest.approx(2.0, abs=1e-5)


def test_resolve_max_positions_keeps_the_type_of_the_limits():
    assert utils.resolve_max_positions(None, (2000, 100, 2000), 12000) == (2000, 100, 2000)
    assert utils.resolve_max_positions(1024, None, 512) == 512
    assert utils.resolve_max_positions((1024, None), (512, 300)) == (512, 300)
    assert utils.resolve_max_positions({"a": 5, "b": 7}, {"a": 3}) == {"a": 3, "b": 7}
    assert utils.resolve_max_positions(None, None) is None


def test_sample_helpers():
    t = torch.tensor([5, 1, 6, 1])
    assert utils.strip_pad(t, 1).tolist() == [5, 6]
    assert utils.item(torch.tensor(3.5)) == 3.5 and utils.item(4) == 4
    sample = {"net_input": {"src_tokens": torch.ones(2, dtype=torch.half)}, "ids": [torch.zeros(1)], "n": 3}
    moved = utils.move_to_cpu(sample)
    assert moved["net_input"]["src_tokens"].dtype == torch.float32 and moved["n"] == 3
    assert utils.apply_to_sample(lambda x: x + 1, {}) == {}
    x = torch.randn(2, 5, dtype=torch.bfloat16)
    assert utils.log_softmax(x, -1).dtype == torch.float32
    assert torch.allclose(utils.softmax(x, -1).sum(-1), torch.ones(2))
    assert utils.get_perplexity(1.0) == 2.0


def test_set_torch_seed_seeds_and_restores():
    torch.manual_seed(0)
    expected_after = torch.rand(3)
    torch.manual_seed(0)
    with utils.set_torch_seed(123):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_after)  # the state before the block came back
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), inside)


def test_import_user_module_takes_upstream_args_objects(tmp_path):
    plugin = tmp_path / "surface_plugin_pkg"
    plugin.mkdir()
    (plugin / "__init__.py").write_text("LOADED = True\n")
    utils.import_user_module(argparse.Namespace(user_dir=str(plugin)))
    import surface_plugin_pkg

    assert surface_plugin_pkg.LOADED
    utils.import_user_module(argparse.Namespace(user_dir=None))  # nothing to import


# ------------------------------------------------------------------------------------------ options


def test_validation_parser_and_suppress_defaults():
    parser = options.get_validation_parser()
    given = options.parse_args_and_arch(
        parser,
        [
            "data-bin",
            "--path",
            "m.pt",
            "--max-tokens",
            "100",
            "--tokens-per-sample",
            "7",
            "--skip-invalid-size-inputs-valid-test",
        ],
        suppress_defaults=True,
    )
    assert vars(given) == {
        "data": "data-bin",
        "path": "m.pt",
        "max_tokens": 100,
        "tokens_per_sample": 7,
        "skip_invalid_size_inputs_valid_test": True,
    }
    full = options.parse_args_and_arch(parser, ["data-bin", "--path", "m.pt", "--max-tokens", "100"])
    assert full.valid_subset == "valid" and full.seed == 1  # the parser's defaults survived


def test_eval_lm_parser_accepts_upstreams_generic_flags():
    args = options.parse_args_and_arch(
        options.get_eval_lm_parser(),
        [
            "data-bin",
            "--path",
            "m.pt",
            "--criterion",
            "cross_entropy",
            "--optimizer",
            "adam",
            "--adam-betas",
            "(0.9, 0.98)",
            "--lr-scheduler",
            "inverse_sqrt",
            "--bpe",
            "gpt2",
            "--tokenizer",
            "space",
        ],
    )
    cfg = options.convert_namespace_to_config(args)
    assert cfg.criterion._name == "cross_entropy" and cfg.bpe._name == "gpt2" and cfg.tokenizer._name == "space"
    assert cfg.optimizer.adam_betas == "(0.9, 0.98)"


def test_training_flags_nval_combine_and_ema():
    from fairseq.dataclass.configs import FairseqConfig
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(
        options.get_training_parser(),
        [
            "data-bin",
            "--arch",
            "transformer_lm",
            "--optimizer",
            "adam",
            "--nval",
            "3",
            "--combine-val",
            "--store-ema",
            "--ema-decay",
            "0.5",
            "--ema-update-freq",
            "2",
            "--ema-fp32",
        ],
    )
    cfg = convert_namespace_to_omegaconf(args)
    assert isinstance(cfg, FairseqConfig)  # the typed config this fork's code takes
    assert cfg.dataset.max_valid_steps == 3 and cfg.dataset.combine_valid_subsets is True
    assert (cfg.ema.store_ema, cfg.ema.ema_decay, cfg.ema.ema_update_freq, cfg.ema.ema_fp32) == (True, 0.5, 2, True)
    with pytest.raises(ValueError, match="--ema-decay must lie in"):
        from fairseq.frontend.validate import validate

        cfg.dataset.max_tokens, cfg.task.tokens_per_sample, cfg.ema.ema_decay = 64, 64, 1.5
        validate(cfg)


def test_legacy_task_with_add_args_gets_the_whole_namespace(tmp_path):
    from fairseq.registry import TASK_REGISTRY
    from fairseq.tasks import LegacyFairseqTask, register_task

    if "surface_legacy_task" not in TASK_REGISTRY:

        @register_task("surface_legacy_task")
        class SurfaceLegacyTask(LegacyFairseqTask):
            @staticmethod
            def add_args(parser):
                parser.add_argument("data")
                parser.add_argument("--legacy-knob", type=int, default=3)

    args = options.parse_args_and_arch(
        options.get_training_parser(),
        [
            str(tmp_path),
            "--task",
            "surface_legacy_task",
            "--legacy-knob",
            "7",
            "--arch",
            "transformer_lm",
            "--optimizer",
            "adam",
        ],
    )
    cfg = options.convert_namespace_to_config(args)
    assert isinstance(cfg.task, argparse.Namespace) and cfg.task.legacy_knob == 7 and cfg.task.data == str(tmp_path)
    task = TASK_REGISTRY.get("surface_legacy_task").setup_task(cfg.task)
    assert task.args is cfg.task and task.has_sharded_data("train") is False
    from fairseq.dataclass.utils import config_to_dict

    assert config_to_dict(cfg)["task"]["legacy_knob"] == 7  # saved as a plain dict in checkpoints


def test_gen_parser_from_dataclass_adds_upstream_flags():
    from fairseq.dataclass.utils import gen_parser_from_dataclass
    from fairseq.tasks.language_modeling import LanguageModelingConfig

    parser = argparse.ArgumentParser()
    gen_parser_from_dataclass(parser, LanguageModelingConfig())
    args = parser.parse_args(["data-bin", "--tokens-per-sample", "64", "--sample-break-mode", "eos"])
    assert (args.data, args.tokens_per_sample, args.sample_break_mode) == ("data-bin", 64, "eos")


# ------------------------------------------------------------------------------------------ files


def test_path_manager_local_files(tmp_path):
    from fairseq.file_io import PathManager

    path = str(tmp_path / "a.txt")
    with PathManager.open(path, "w") as f:
        f.write("hello\n")
    assert PathManager.exists(path) and PathManager.isfile(path) and PathManager.ls(str(tmp_path)) == ["a.txt"]
    PathManager.copy(path, str(tmp_path / "b.txt"))
    with pytest.raises(FileExistsError):
        PathManager.copy(path, str(tmp_path / "b.txt"))
    PathManager.mkdirs(str(tmp_path / "d" / "e"))
    PathManager.rm(str(tmp_path / "b.txt"))
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "d"] and PathManager.get_local_path(path) == path


def test_tokenize_line_is_the_dictionarys():
    from fairseq.data.dictionary import tokenize_line as dictionary_tokenize
    from fairseq.tokenizer import tokenize_line

    assert tokenize_line is dictionary_tokenize
    assert tokenize_line("  a\tb \u3000c\n") == ["a", "b", "c"]


# ------------------------------------------------------------------------------ activations, fp16


def test_checkpoint_wrapper_gives_the_same_outputs_and_gradients():
    from fairseq.modules.checkpoint_activations import checkpoint_wrapper, unwrap_checkpoint

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    for offload in (False, True):
        wrapped = checkpoint_wrapper(copy.deepcopy(plain), offload_to_cpu=offload)
        assert list(wrapped.state_dict()) == list(plain.state_dict())
        y_ref, y = plain(x), wrapped(x)
        y_ref.square().sum().backward()
        y.square().sum().backward()
        assert torch.equal(y, y_ref)
        for p_ref, p in zip(plain.parameters(), wrapped.parameters()):
            assert torch.allclose(p.grad, p_ref.grad, rtol=1e-6, atol=1e-7)
        plain.zero_grad()
        clone = copy.deepcopy(wrapped)  # the copy runs its own weights
        assert clone.forward.__self__ is clone and clone.precheckpoint_forward.__self__ is clone
        assert "forward" not in unwrap_checkpoint(wrapped).__dict__
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint_wrapper(checkpoint_wrapper(torch.nn.Linear(2, 2)))


def _fp16_cfg(*flags):
    args = options.parse_args_and_arch(
        options.get_training_parser(),
        [
            "data-bin",
            "--arch",
            "transformer_lm",
            "--optimizer",
            "adam",
            "--lr",
            "0.1",
            "--max-tokens",
            "8",
            "--tokens-per-sample",
            "8",
            *flags,
        ],
    )
    return options.convert_namespace_to_config(args)


def test_fp16_optimizer_names_do_the_trainers_fp16_update():
    from fairseq.optim.fp16_optimizer import FP16Optimizer, MemoryEfficientFP16Optimizer

    for cls in (FP16Optimizer, MemoryEfficientFP16Optimizer):
        model = torch.nn.Linear(1, 1)
        model.weight.data, model.bias.data = torch.tensor([[3.0]]), torch.tensor([5.0])
        optimizer = cls.build_optimizer(
            _fp16_cfg("--fp16-init-scale", "1", "--fp16-scale-window", "1"), model.parameters()
        )
        loss = torch.nn.L1Loss()(model(torch.tensor([2.0])), torch.tensor([12.0]))
        optimizer.backward(loss)
        assert optimizer.clip_grad_norm(0).item() == pytest.approx(5**0.5, rel=1e-6)  # |grad| = (2, 1)
        optimizer.step()
        # Adam's first step moves each weight by lr against its gradient's sign: upstream's test values
        assert model.weight.item() == pytest.approx(3.1, abs=1e-6) and model.bias.item() == pytest.approx(5.1, abs=1e-6)
        assert optimizer.scaler.loss_scale == 2.0  # one clean update with --fp16-scale-window 1 doubles it


def test_fp16_optimizer_overflow_skips_and_halves_the_scale():
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    model = torch.nn.Linear(2, 1)
    optimizer = FP16Optimizer.build_optimizer(_fp16_cfg("--fp16-init-scale", "8"), model.parameters())
    optimizer.backward(model(torch.tensor([[float("inf"), 1.0]])).sum())
    with pytest.raises(OverflowError, match="setting loss scale to: 4.0"):
        optimizer.clip_grad_norm(1.0)
    with pytest.raises(ValueError, match="keeps parameters in fp32"):
        FP16Optimizer.build_optimizer(_fp16_cfg(), torch.nn.Linear(2, 2).half().parameters())


def test_fp16_optimizer_reads_upstreams_partial_configs():
    """Upstream's tests construct the optimizer with partial DictConfigs: the options they lack take the
    trainer's defaults (window 2**14 over --update-freq), the ones they give are used."""
    from omegaconf import OmegaConf

    from fairseq.optim.fp16_optimizer import FP16Optimizer

    def scaler(optimization, common):
        cfg = OmegaConf.create({"optimization": optimization, "common": common})
        model = torch.nn.Linear(1, 1)
        s = FP16Optimizer(cfg, list(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1)).scaler
        return s.loss_scale, s.scale_window, s.tolerance, s.threshold, s.min_loss_scale

    given = {"fp16_init_scale": 1, "fp16_scale_window": 1, "fp16_scale_tolerance": 1, "threshold_loss_scale": 1}
    assert scaler({"lr": [0.1]}, given) == (1.0, 1, 1, 1, 1e-4)
    assert scaler({"lr": [0.1]}, {}) == (128.0, 16384, 0.0, None, 1e-4)
    assert scaler({"lr": [0.1], "update_freq": [4]}, {}) == (128.0, 4096, 0.0, None, 1e-4)


def test_the_core_never_loads_the_wing_and_upstreams_names_find_it():
    """Every registry loaded (each package's modules imported) and the trainer, loop and training entry point
    imported: no fairseq.compat module is loaded. Upstream's names in the core's packages then load the wing's
    module, under both names (the same object)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from fairseq import registry\n"
        "import fairseq.training.trainer, fairseq.training.loop, fairseq_cli.train\n"
        "for reg in (registry.TASK_REGISTRY, registry.MODEL_REGISTRY, registry.CRITERION_REGISTRY,\n"
        "            registry.OPTIMIZER_REGISTRY, registry.LR_SCHEDULER_REGISTRY, registry.BPE_REGISTRY):\n"
        "    assert reg.choices()\n"
        "print(sorted(m for m in sys.modules if m.startswith('fairseq.compat')))\n"
        "from fairseq.data import LanguagePairDataset\n"
        "import fairseq.data.language_pair_dataset as face, fairseq.compat.language_pair_dataset as wing\n"
        "print(face is wing, LanguagePairDataset is wing.LanguagePairDataset)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True True"]
