"""--patience: stop after that many validations in a row without improvement."""

from fairseq.checkpoint.manager import CheckpointManager
from fairseq.dataclass.configs import FairseqConfig


def manager(patience, maximize=False):
    cfg = FairseqConfig()
    cfg.checkpoint.patience = patience
    cfg.checkpoint.maximize_best_checkpoint_metric = maximize
    return CheckpointManager(cfg)


def test_stops_after_patience_validations_without_improvement():
    m = manager(2)
    assert [m.should_stop_early(v) for v in (5.0, 4.0, 4.5, 4.0, 3.9, 4.1, 4.2)] == [
        False,
        False,
        False,
        True,
        False,
        False,
        True,
    ]


def test_maximized_metric_and_disabled_patience():
    m = manager(1, maximize=True)
    assert [m.should_stop_early(v) for v in (0.1, 0.2, 0.15)] == [False, False, True]
    off = manager(-1)
    assert not any(off.should_stop_early(v) for v in (1.0, 2.0, 3.0, 4.0))
    assert manager(1).should_stop_early(None) is False
