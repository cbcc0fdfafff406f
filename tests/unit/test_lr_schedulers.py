"""Learning rates at chosen updates, against values worked out by hand from upstream fairseq's formulas."""

import argparse
import math

import pytest
import torch

from fairseq.dataclass.configs import OptimizationConfig
from fairseq.dataclass.utils import add_dataclass_to_parser, config_from_namespace
from fairseq.optim.lr_scheduler import LR_SCHEDULER_REGISTRY, build_lr_scheduler
from fairseq.optim.lr_scheduler.cosine_lr_scheduler import CosineLRScheduleConfig
from fairseq.optim.lr_scheduler.fixed_schedule import FixedLRScheduleConfig
from fairseq.optim.lr_scheduler.inverse_square_root_schedule import InverseSquareRootLRScheduleConfig
from fairseq.optim.lr_scheduler.polynomial_decay_schedule import (
    PolynomialDecayLRSchedule,
    PolynomialDecayLRScheduleConfig,
)


def make_optimizer():
    param = torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([{"params": [param]}, {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=123.0)


def build(name, lr, max_update=0, **flags):
    cfg = LR_SCHEDULER_REGISTRY.dataclass(name)(**flags)
    cfg._name = name
    optimizer = make_optimizer()
    scheduler = build_lr_scheduler(cfg, optimizer, OptimizationConfig(lr=lr, max_update=max_update))
    return scheduler, optimizer


def lr_at(scheduler, optimizer, num_updates):
    lr = scheduler.step_update(num_updates)
    # Every parameter group follows the schedule, and the returned value is the one set.
    assert [g["lr"] for g in optimizer.param_groups] == [lr, lr]
    return lr


# ---- inverse_sqrt ----


def test_inverse_sqrt_warmup_then_decay():
    sched, opt = build("inverse_sqrt", [0.0005], warmup_updates=4000, warmup_init_lr=1e-7)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-7, rel=1e-12)  # set at build: update 0
    assert lr_at(sched, opt, 0) == pytest.approx(1e-7, rel=1e-12)
    assert lr_at(sched, opt, 2000) == pytest.approx(1e-7 + 2000 * (0.0005 - 1e-7) / 4000, rel=1e-12)
    assert lr_at(sched, opt, 3999) == pytest.approx(1e-7 + 3999 * (0.0005 - 1e-7) / 4000, rel=1e-12)
    assert lr_at(sched, opt, 4000) == pytest.approx(0.0005, rel=1e-12)  # warmup end meets the decay
    assert lr_at(sched, opt, 16000) == pytest.approx(0.00025, rel=1e-12)  # 0.0005 * sqrt(4000 / 16000)
    assert lr_at(sched, opt, 50000) == pytest.approx(0.0005 * math.sqrt(4000) / math.sqrt(50000), rel=1e-12)


def test_inverse_sqrt_default_warmup_init_lr_is_zero():
    sched, opt = build("inverse_sqrt", [0.001])  # upstream defaults: 4000 warmup updates, init lr -1 -> 0
    assert sched.cfg.warmup_updates == 4000
    assert lr_at(sched, opt, 0) == 0.0
    assert lr_at(sched, opt, 1000) == pytest.approx(0.00025, rel=1e-12)


def test_inverse_sqrt_rejects_bad_settings():
    with pytest.raises(ValueError, match="--lr .*one learning rate"):
        build("inverse_sqrt", [0.1, 0.2])
    with pytest.raises(ValueError, match="--warmup-updates 0"):
        build("inverse_sqrt", [0.1], warmup_updates=0)


# ---- fixed ----


def test_fixed_warmup_and_lr_per_epoch():
    sched, opt = build("fixed", [1.0, 0.5], warmup_updates=4)
    assert opt.param_groups[0]["lr"] == 0.25  # (0 + 1) / 4 at update 0
    assert lr_at(sched, opt, 1) == 0.5
    assert lr_at(sched, opt, 3) == 1.0
    assert lr_at(sched, opt, 4) == 1.0
    assert sched.step_begin_epoch(1) == 1.0
    assert sched.step_begin_epoch(2) == 0.5
    assert lr_at(sched, opt, 10) == 0.5
    assert sched.step_begin_epoch(7) == 0.5  # past the list: its last value


def test_fixed_force_anneal():
    sched, opt = build("fixed", [2.0], force_anneal=2, lr_shrink=0.5)
    assert lr_at(sched, opt, 0) == 2.0
    assert sched.step_begin_epoch(1) == 2.0
    assert sched.step_begin_epoch(2) == 1.0  # 2.0 * 0.5 ** (2 + 1 - 2)
    assert sched.step_begin_epoch(4) == 0.25
    assert lr_at(sched, opt, 100) == 0.25


def test_fixed_state_dict_round_trip_keeps_lr_and_best():
    sched, opt = build("fixed", [2.0], force_anneal=1, lr_shrink=0.5)
    sched.step_begin_epoch(3)  # 2.0 * 0.5 ** 3
    sched.step(3, val_loss=4.0)
    sched.step(4, val_loss=3.5)
    state = sched.state_dict()
    assert state == {"best": 3.5, "lr": 0.25}
    fresh, fresh_opt = build("fixed", [2.0], force_anneal=1, lr_shrink=0.5)
    fresh.load_state_dict(state)
    assert fresh.best == 3.5
    assert lr_at(fresh, fresh_opt, 7) == 0.25
    fresh.load_state_dict({"lr": 0.125})  # an upstream fixed-schedule state has no "best"
    assert fresh.best is None and lr_at(fresh, fresh_opt, 7) == 0.125


# ---- polynomial_decay ----


def test_polynomial_decay_warmup_and_decay():
    sched, opt = build(
        "polynomial_decay", [1.0], warmup_updates=10, total_num_update=110, end_learning_rate=0.1, power=2.0
    )
    # As upstream: the builder's step_update(0) gives warmup factor 0, so the first update runs at lr 0.
    assert opt.param_groups[0]["lr"] == 0.0
    assert lr_at(sched, opt, 5) == 0.5
    assert lr_at(sched, opt, 10) == 1.0
    assert lr_at(sched, opt, 60) == pytest.approx(0.9 * 0.5**2 + 0.1, rel=1e-12)
    assert lr_at(sched, opt, 85) == pytest.approx(0.9 * 0.25**2 + 0.1, rel=1e-12)
    assert lr_at(sched, opt, 110) == 0.1
    assert lr_at(sched, opt, 500) == 0.1


def test_polynomial_decay_constructor_sets_lr_over_warmup():
    # Before any step_update, upstream's constructor sets lr / warmup_updates.
    cfg = PolynomialDecayLRScheduleConfig(warmup_updates=4, total_num_update=100)
    optimizer = make_optimizer()
    PolynomialDecayLRSchedule(cfg, optimizer, [1.0], 0)
    assert optimizer.param_groups[0]["lr"] == 0.25


def test_polynomial_decay_total_defaults_to_max_update_and_linear_power():
    sched, opt = build("polynomial_decay", [0.5], max_update=100)
    assert sched.total_num_update == 100
    assert lr_at(sched, opt, 0) == 0.5  # no warmup
    assert lr_at(sched, opt, 25) == pytest.approx(0.375, rel=1e-12)
    assert lr_at(sched, opt, 100) == 0.0


def test_polynomial_decay_zero_lr_warmup_steps():
    sched, opt = build("polynomial_decay", [1.0], warmup_updates=10, zero_lr_warmup_steps=5, total_num_update=115)
    assert lr_at(sched, opt, 5) == 0.0
    assert lr_at(sched, opt, 10) == 0.5
    assert lr_at(sched, opt, 15) == 1.0
    assert lr_at(sched, opt, 65) == pytest.approx(0.5, rel=1e-12)


def test_epoch_calls_return_the_rate_of_the_current_update():
    # Upstream's trainer follows step_begin_epoch / step with step_update(num_updates); here they do it
    # themselves, so a new epoch in the decay phase does not jump back to the peak rate.
    sched, opt = build("polynomial_decay", [1.0], warmup_updates=4, total_num_update=100)
    lr_at(sched, opt, 1)
    assert sched.step_begin_epoch(1) == 0.25
    assert lr_at(sched, opt, 52) == 0.5  # 1.0 * (1 - 48 / 96)
    assert sched.step_begin_epoch(2) == 0.5 and opt.param_groups[0]["lr"] == 0.5
    assert sched.step(2, val_loss=1.0) == 0.5
    fixed, fixed_opt = build("fixed", [1.0, 0.5], warmup_updates=10)
    lr_at(fixed, fixed_opt, 4)
    assert fixed.step_begin_epoch(2) == 0.25  # epoch 2's rate 0.5, still warming up: (4 + 1) / 10


def test_polynomial_decay_force_anneal_keeps_current_rate_as_peak():
    sched, opt = build("polynomial_decay", [1.0], total_num_update=100, force_anneal=2)
    lr_at(sched, opt, 50)  # 0.5
    assert sched.step_begin_epoch(2) == pytest.approx(0.25, rel=1e-12)  # new peak 0.5, decayed halfway


def test_polynomial_decay_needs_a_length():
    with pytest.raises(ValueError, match="--total-num-update N or --max-update N"):
        build("polynomial_decay", [1.0])


# ---- cosine ----


def test_cosine_warmup_and_shrinking_cycles():
    sched, opt = build("cosine", [1.0], max_update=110, warmup_updates=10, min_lr=0.1)
    assert lr_at(sched, opt, 0) == pytest.approx(0.1, rel=1e-12)  # warmup_init_lr -1 -> min_lr
    assert lr_at(sched, opt, 5) == pytest.approx(0.55, rel=1e-12)
    assert lr_at(sched, opt, 10) == pytest.approx(1.0, rel=1e-12)
    assert lr_at(sched, opt, 35) == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)), rel=1e-12)
    assert lr_at(sched, opt, 60) == pytest.approx(0.55, rel=1e-12)
    # Period 110 - 10 = 100; the second cycle restarts at lr * 0.1 with min_lr * 0.1.
    assert lr_at(sched, opt, 110) == pytest.approx(0.1, rel=1e-12)
    assert lr_at(sched, opt, 160) == pytest.approx(0.055, rel=1e-12)


def test_cosine_t_mult_grows_cycles():
    sched, opt = build("cosine", [1.0], lr_period_updates=100, t_mult=2.0, lr_shrink=0.5)
    assert lr_at(sched, opt, 0) == pytest.approx(1.0, rel=1e-12)
    assert lr_at(sched, opt, 50) == pytest.approx(0.5, rel=1e-12)
    assert lr_at(sched, opt, 100) == pytest.approx(0.5, rel=1e-12)  # cycle 1 (200 long) starts at 0.5
    assert lr_at(sched, opt, 200) == pytest.approx(0.25, rel=1e-12)  # its middle
    assert lr_at(sched, opt, 300) == pytest.approx(0.25, rel=1e-12)  # cycle 2 (400 long) starts at 0.25


def test_cosine_explicit_warmup_init_lr():
    sched, opt = build("cosine", [1.0], max_update=20, warmup_updates=10, warmup_init_lr=0.0)
    assert lr_at(sched, opt, 0) == 0.0
    assert lr_at(sched, opt, 4) == pytest.approx(0.4, rel=1e-12)


def test_cosine_min_lr_at_or_above_lr_gives_a_constant_rate():
    for min_lr in (0.1, 0.2):  # upstream lowers --min-lr to --lr
        sched, opt = build("cosine", [0.1], max_update=10, min_lr=min_lr)
        assert [lr_at(sched, opt, n) for n in (0, 3, 7)] == [0.1, 0.1, 0.1]


def test_cosine_rejects_bad_settings():
    with pytest.raises(ValueError, match="--lr-period-updates"):
        build("cosine", [0.1])
    with pytest.raises(ValueError, match="one learning rate"):
        build("cosine", [0.1, 0.2], max_update=10)


# ---- shared behaviour ----


@pytest.mark.parametrize(
    "name,flags",
    [
        ("inverse_sqrt", {"warmup_updates": 10}),
        ("polynomial_decay", {"warmup_updates": 10, "total_num_update": 50}),
        ("cosine", {"warmup_updates": 10, "lr_period_updates": 30}),
    ],
)
def test_state_dict_round_trip_restores_best_and_schedule(name, flags):
    sched, opt = build(name, [0.5], **flags)
    for update in range(1, 25):
        lr_at(sched, opt, update)
    sched.step(1, val_loss=3.0)
    sched.step(2, val_loss=2.0)
    assert sched.step(3, val_loss=2.5) == opt.param_groups[0]["lr"]
    state = sched.state_dict()
    assert state == {"best": 2.0}
    resumed, resumed_opt = build(name, [0.5], **flags)
    resumed.load_state_dict(state)
    assert resumed.best == 2.0
    for update in (24, 25, 37):
        assert lr_at(resumed, resumed_opt, update) == lr_at(sched, opt, update)


def test_flags_generated_with_upstream_defaults():
    expected = {
        FixedLRScheduleConfig: ["--force-anneal", "3", "--lr-shrink", "0.5", "--warmup-updates", "7"],
        InverseSquareRootLRScheduleConfig: ["--warmup-updates", "7", "--warmup-init-lr", "1e-07"],
        PolynomialDecayLRScheduleConfig: ["--end-learning-rate", "0.01", "--power", "2", "--total-num-update", "10"],
        CosineLRScheduleConfig: ["--min-lr", "1e-5", "--t-mult", "2", "--lr-period-updates", "9"],
    }
    defaults = {
        FixedLRScheduleConfig: dict(force_anneal=None, lr_shrink=0.1, warmup_updates=0),
        InverseSquareRootLRScheduleConfig: dict(warmup_updates=4000, warmup_init_lr=-1.0),
        PolynomialDecayLRScheduleConfig: dict(
            warmup_updates=0, end_learning_rate=0.0, power=1.0, total_num_update=None, zero_lr_warmup_steps=0
        ),
        CosineLRScheduleConfig: dict(
            warmup_updates=0, warmup_init_lr=-1.0, min_lr=0.0, t_mult=1.0, lr_period_updates=-1.0, lr_shrink=0.1
        ),
    }
    for dc, argv in expected.items():
        parser = argparse.ArgumentParser()
        add_dataclass_to_parser(parser, dc)
        default_cfg = config_from_namespace(dc, parser.parse_args([]))
        for key, value in defaults[dc].items():
            assert getattr(default_cfg, key) == value, (dc.__name__, key)
        cfg = config_from_namespace(dc, parser.parse_args(argv))
        assert cfg != default_cfg
    parser = argparse.ArgumentParser()
    add_dataclass_to_parser(parser, PolynomialDecayLRScheduleConfig)
    assert (
        config_from_namespace(
            PolynomialDecayLRScheduleConfig, parser.parse_args(["--total-num-update", "10"])
        ).total_num_update
        == 10.0
    )
