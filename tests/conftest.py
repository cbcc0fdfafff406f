"""Shared test fixtures: a tiny corpus preprocessed by the real fairseq-preprocess, fairseq-train command lines
for tiny models, and --user-dir plug-ins (among them criterions that fail on purpose)."""

import os

import pytest
import torch

from tests.train_fixtures import default_train_argv, tiny_train_argv, write_corpus, write_plugin  # noqa: F401

if not torch.cuda.is_available():
    # Inductor compiles in the process that compiles. By default it starts a pool of worker processes for that
    # (one per core), each a Python importing torch: ~3 s of CPU per compiling process, for tiny graphs that
    # gain nothing from it (tests/unit's compiled decode and int8 tests: 37.9 -> 34.5 s of CPU). Subprocesses
    # and ranks inherit it. Read when torch._inductor.config is imported; a value already set is kept.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread_on_cpu():
    """The CPU suite's tiny models run on one intra-op thread: they gain nothing from more, and on a 2-core
    machine waiting for the threads costs (train/export/eval-lm integration modules: 55 s of CPU on one thread,
    70-110 s on two, with other work on the machine). Left alone where CUDA is available. Returns torch's own
    thread count (see torch_default_threads)."""
    import torch

    threads = torch.get_num_threads()
    if torch.cuda.is_available():
        yield threads
        return
    torch.set_num_threads(1)
    yield threads
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def torch_default_threads(one_intra_op_thread_on_cpu):
    """torch's own intra-op thread count for a module, for runs that must compute bitwise what a run with torch's
    defaults computed (a stored checkpoint): the sums of a matrix product depend on how it is split."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(one_intra_op_thread_on_cpu)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models: they gain nothing from more, and on a shared machine
    waiting for the threads dominates. Use with `pytestmark = pytest.mark.usefixtures("one_thread")` (on a
    machine without CUDA every test has one already: one_intra_op_thread_on_cpu)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_rank_group():
    """A one-process gloo group (an in-memory store) for the test, for code that needs torch.distributed
    initialized: FSDP2 and DTensors on a one-rank mesh. A group that already exists is kept."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


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
    cli_main(
        [
            "--only-source",
            "--trainpref",
            str(text / "train.txt"),
            "--validpref",
            str(text / "valid.txt"),
            "--testpref",
            str(text / "test.txt"),
            "--destdir",
            str(dest),
            "--workers",
            "1",
        ]
    )
    return dest


@pytest.fixture(scope="session")
def build_train_args():
    """tiny_train_argv: fairseq-train's arguments as a plain list, each difference between runs a parameter."""
    return tiny_train_argv


@pytest.fixture(scope="session")
def train_args():
    """train_args(data, save_dir, *extra, max_update=8): fairseq-train's arguments as a plain list for the
    tiny transformer_lm (default_train_argv); tests change it by extra flags or by editing the list."""
    return default_train_argv


@pytest.fixture(scope="session")
def tiny_lm_checkpoint(tiny_data, tmp_path_factory):
    """checkpoint_last.pt of the tiny transformer_lm trained 8 updates on tiny_data (default_train_argv), trained
    once for the session; tests only read it."""
    from fairseq_cli import train

    save_dir = tmp_path_factory.mktemp("tiny_lm")
    train.cli_main(default_train_argv(tiny_data, save_dir, max_update=8))
    return save_dir / "checkpoint_last.pt"


# ----------------------------------------------------------------------------- --user-dir plug-ins


@pytest.fixture
def user_dir(tmp_path):
    """user_dir(name, source): a --user-dir plug-in, the directory tmp_path/name with `source` as __init__.py
    (the directory's name is the module's: a name imported twice in one process must be the same plug-in)."""
    return lambda name, source: write_plugin(tmp_path / name, source)


FAULTY_CRITERION = """
import torch.distributed as dist
from fairseq.registry import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig

CALL, AND_AFTER, RANK, ERROR, FACTOR, ALSO_LOGGED = {settings}


@register_criterion({name!r}, dataclass=CrossEntropyCriterionConfig)
class FaultyCrossEntropy(CrossEntropyCriterion):
    def __init__(self, task, sentence_avg):
        super().__init__(task, sentence_avg)
        self.calls = 0  # one criterion per run: in-process runs count afresh

    def forward(self, model, sample, reduce=True):
        self.calls += 1
        faulty = self.calls == CALL or (AND_AFTER and self.calls > CALL)
        faulty = faulty and (RANK is None or dist.get_rank() == RANK)
        if faulty and ERROR is not None:
            raise RuntimeError(ERROR)
        loss, size, log = super().forward(model, sample, reduce)
        if faulty and FACTOR is not None:
            loss = loss * float(FACTOR)
            if ALSO_LOGGED:
                log = dict(log, loss=log["loss"] * float(FACTOR))
        return loss, size, log
"""


@pytest.fixture
def faulty_criterion(user_dir):
    """faulty_criterion(directory, name, *, call, and_after=False, rank=None, error=None, factor=None,
    also_logged=False): the --user-dir (user_dir(directory, ...)) of a criterion `name` that is cross_entropy
    except on its `call`-th forward call in a run (and every later one with and_after; on distributed rank
    `rank` only, if given): there it raises RuntimeError(error), or multiplies the loss by float(factor)
    ("nan", "inf"), and with also_logged the logged loss too."""
    return lambda directory, name, **settings: user_dir(directory, faulty_criterion_source(name, **settings))


def faulty_criterion_source(name, *, call, and_after=False, rank=None, error=None, factor=None, also_logged=False):
    assert (error is None) != (factor is None), "a faulty criterion raises or scales the loss"
    settings = repr((call, and_after, rank, error, factor, also_logged))
    return FAULTY_CRITERION.format(settings=settings, name=name)


@pytest.fixture(scope="session")
def nan_after_two(tmp_path_factory):
    """The --user-dir of criterion "nan_after_two": cross_entropy, then a nan loss (and logged loss) from its
    third forward call in a run on. One directory for the session, so that runs in the test process import
    the one plug-in."""
    source = faulty_criterion_source("nan_after_two", call=3, and_after=True, factor="nan", also_logged=True)
    return write_plugin(tmp_path_factory.mktemp("plugins") / "nan_plugin", source)


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """fairseq-train run in the test process under fully_sharded creates a one-rank process group (FSDP2 needs
    one) and leaves it, as a library call should; a test that did not have one before gets none after, so that
    the next test starts as a fresh process would."""
    import torch.distributed as dist

    existed = dist.is_available() and dist.is_initialized()
    yield
    if not existed and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def working_directory_kept():
    """A test that changes the working directory must use monkeypatch.chdir: a directory left behind holds that
    test's checkpoints/, which a later fairseq-train with the default --save-dir would resume from."""
    before = os.getcwd()
    yield
    after = os.getcwd()
    if after != before:
        os.chdir(before)
        pytest.fail(f"the test left the working directory at {after}; use monkeypatch.chdir", pytrace=False)
