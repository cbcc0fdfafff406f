"""Shared test fixtures: a tiny corpus preprocessed by the real fairseq-preprocess, fairseq-train command lines
for tiny models, and --user-dir plug-ins (among them criterions that fail on purpose)."""

import os
import random

import pytest


def write_corpus(path, num_lines, seed, vocab=60, min_len=3, max_len=25):
    """Deterministic pseudo-text: words drawn from a skewed vocabulary so a model can learn something."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab)]
    weights = [1.0 / (i + 1) for i in range(vocab)]
    with open(path, "w") as f:
        for _ in range(num_lines):
            n = rng.randint(min_len, max_len)
            f.write(" ".join(rng.choices(words, weights, k=n)) + "\n")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A preprocessed language-modeling data directory (train/valid/test) made by fairseq-preprocess."""
    from fairseq_cli.preprocess import cli_main

    root = tmp_path_factory.mktemp("tiny")
    text = root / "text"
    text.mkdir()
    write_corpus(text / "train.txt", 400, seed=1)
    write_corpus(text / "valid.txt", 40, seed=2)
    write_corpus(text / "test.txt", 40, seed=3)
    dest = root / "data-bin"
    cli_main([
        "--only-source", "--trainpref", str(text / "train.txt"), "--validpref", str(text / "valid.txt"),
        "--testpref", str(text / "test.txt"), "--destdir", str(dest), "--workers", "1",
    ])
    return dest


# ----------------------------------------------------------------------------- fairseq-train command lines

# Two tiny decoders ("transformer_lm": 2 layers of 32, tied embeddings with 32-wide input and output; a 2-layer
# "transformer_lm_gpt" of 32), with the learning rate and batch shape the tests train them with by default.
TINY_MODELS = {
    "transformer_lm": {
        "model": ["--arch", "transformer_lm", "--decoder-layers", "2", "--decoder-embed-dim", "32",
                  "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2", "--decoder-input-dim", "32",
                  "--decoder-output-dim", "32", "--share-decoder-input-output-embed"],
        "lr": "0.002",
        "batch": ["--max-tokens", "256"],
    },
    "transformer_lm_gpt": {
        "model": ["--arch", "transformer_lm_gpt", "--decoder-layers", "2", "--decoder-embed-dim", "32",
                  "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2"],
        "lr": "0.003",
        "batch": ["--batch-size", "4"],
    },
}

# What `train_args` adds: regularisation and a warmed-up schedule, blocks across sentence boundaries.
TRAIN_RECIPE = [
    "--dropout", "0.1", "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.01", "--clip-norm", "1.0",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4", "--sample-break-mode", "none",
]


def tiny_train_argv(data, save_dir, *extra, max_update, arch="transformer_lm", lr=None, seed="3", json_log=True,
                    log_file=True):
    """fairseq-train's arguments (no program name) for the tiny `arch` on `data`, on the CPU: adam at `lr`
    (default: the model's), --tokens-per-sample 32, the model's --max-tokens or --batch-size, --num-workers 0,
    --seed `seed` (None: no --seed), with json_log --log-format json --log-interval 1, with log_file
    --log-file SAVE_DIR/train.log; then `extra`."""
    preset = TINY_MODELS[arch]
    argv = [
        "--task", "language_modeling", str(data), "--save-dir", str(save_dir), *preset["model"],
        "--optimizer", "adam", "--lr", preset["lr"] if lr is None else lr, "--tokens-per-sample", "32",
        *preset["batch"], "--max-update", str(max_update),
        "--num-workers", "0", "--cpu",
    ]
    if seed is not None:
        argv += ["--seed", seed]
    if json_log:
        argv += ["--log-format", "json", "--log-interval", "1"]
    if log_file:
        argv += ["--log-file", os.path.join(str(save_dir), "train.log")]
    return argv + list(extra)


def default_train_argv(data, save_dir, *extra, max_update=8):
    """The tiny transformer_lm with TRAIN_RECIPE, --seed 3, a json --log-file in save_dir."""
    return tiny_train_argv(data, save_dir, *TRAIN_RECIPE, *extra, max_update=max_update)


@pytest.fixture(scope="session")
def build_train_args():
    """tiny_train_argv: fairseq-train's arguments as a plain list, each difference between runs a parameter."""
    return tiny_train_argv


@pytest.fixture(scope="session")
def train_args():
    """train_args(data, save_dir, *extra, max_update=8): fairseq-train's arguments as a plain list for the
    tiny transformer_lm (default_train_argv); tests change it by extra flags or by editing the list."""
    return default_train_argv


# ----------------------------------------------------------------------------- --user-dir plug-ins


@pytest.fixture
def user_dir(tmp_path):
    """user_dir(name, source): a --user-dir plug-in, the directory tmp_path/name with `source` as __init__.py
    (the directory's name is the module's: a name imported twice in one process must be the same plug-in)."""
    def write(name, source):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "__init__.py").write_text(source)
        return directory

    return write


FAULTY_CRITERION = '''
import torch.distributed as dist
from fairseq.registry import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig

CALL, AND_AFTER, RANK, ERROR, FACTOR, ALSO_LOGGED = {settings}


@register_criterion({name!r}, dataclass=CrossEntropyCriterionConfig)
class FaultyCrossEntropy(CrossEntropyCriterion):
    calls = 0

    def forward(self, model, sample, reduce=True):
        FaultyCrossEntropy.calls += 1
        faulty = FaultyCrossEntropy.calls == CALL or (AND_AFTER and FaultyCrossEntropy.calls > CALL)
        faulty = faulty and (RANK is None or dist.get_rank() == RANK)
        if faulty and ERROR is not None:
            raise RuntimeError(ERROR)
        loss, size, log = super().forward(model, sample, reduce)
        if faulty and FACTOR is not None:
            loss = loss * float(FACTOR)
            if ALSO_LOGGED:
                log = dict(log, loss=log["loss"] * float(FACTOR))
        return loss, size, log
'''


@pytest.fixture
def faulty_criterion(user_dir):
    """faulty_criterion(directory, name, *, call, and_after=False, rank=None, error=None, factor=None,
    also_logged=False): the --user-dir (user_dir(directory, ...)) of a criterion `name` that is cross_entropy
    except on its `call`-th forward call in a process (and every later one with and_after; on distributed
    rank `rank` only, if given): there it raises RuntimeError(error), or multiplies the loss by float(factor)
    ("nan", "inf"), and with also_logged the logged loss too."""
    def write(directory, name, *, call, and_after=False, rank=None, error=None, factor=None, also_logged=False):
        assert (error is None) != (factor is None), "a faulty criterion raises or scales the loss"
        settings = repr((call, and_after, rank, error, factor, also_logged))
        return user_dir(directory, FAULTY_CRITERION.format(settings=settings, name=name))

    return write


@pytest.fixture
def nan_after_two(faulty_criterion):
    """The --user-dir of criterion "nan_after_two": cross_entropy, then a nan loss (and logged loss) from its
    third forward call on."""
    return faulty_criterion("nan_plugin", "nan_after_two", call=3, and_after=True, factor="nan", also_logged=True)
