"""--optimizer nag against updates worked out by hand from upstream's rule, and --lr-scheduler
reduce_lr_on_plateau's learning rates for given validation values (warmup, patience, threshold, maximize),
both through their flags and across a state-dict round trip."""

import argparse

import pytest
import torch

from fairseq.dataclass.configs import OptimizationConfig
from fairseq.dataclass.utils import add_dataclass_to_parser, config_from_namespace
from fairseq.optim import build_optimizer
from fairseq.optim.lr_scheduler import LR_SCHEDULER_REGISTRY, build_lr_scheduler
from fairseq.optim.nag import NAG, NAGConfig


def nag_cfg(argv):
    parser = argparse.ArgumentParser()
    add_dataclass_to_parser(parser, NAGConfig)
    return config_from_namespace(NAGConfig, parser.parse_args(argv), "nag")


def build_nag(param, lr, argv=()):
    return build_optimizer(nag_cfg(list(argv)), [param], OptimizationConfig(lr=[lr]))


def set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr


def step(optimizer, param, grad):
    param.grad = torch.tensor([grad], dtype=param.dtype)
    optimizer.step()


# ----------------------------------------------------------------------------- NAG


def test_nag_flags_and_defaults_are_upstreams():
    assert nag_cfg([]) == NAGConfig(momentum=0.99, weight_decay=0.0)
    optimizer = build_nag(torch.nn.Parameter(torch.zeros(1)), 0.25, ["--momentum", "0.9", "--weight-decay", "0.01"])
    assert isinstance(optimizer, NAG)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["lr_old"], group["momentum"], group["weight_decay"]) == (0.25, 0.25, 0.9, 0.01)


def test_nag_update_equals_the_hand_computation():
    """p0 = 1, momentum 0.9, no weight decay; gradients 0.5, 0.5, -1 at lr 0.1, 0.1, 0.05:
    step 1: p = 1 - 1.9 * 0.1 * 0.5 = 0.905,                         buf = -0.1 * 0.5 = -0.05
    step 2: p = 0.905 + 0.81 * (-0.05) - 0.095 = 0.7695,              buf = 0.9 * -0.05 - 0.05 = -0.095
    step 3 (lr_correct = 0.05 / 0.1 = 0.5):
            p = 0.7695 + 0.81 * 0.5 * (-0.095) + 1.9 * 0.05 = 0.826025, buf = 0.45 * -0.095 + 0.05 = 0.00725"""
    param = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    optimizer = build_nag(param, 0.1, ["--momentum", "0.9"])
    step(optimizer, param, 0.5)
    assert param.item() == pytest.approx(0.905, abs=1e-15)
    step(optimizer, param, 0.5)
    assert param.item() == pytest.approx(0.7695, abs=1e-15)
    set_lr(optimizer, 0.05)
    step(optimizer, param, -1.0)
    assert param.item() == pytest.approx(0.826025, abs=1e-15)
    assert float(optimizer.state[param]["momentum_buffer"]) == pytest.approx(0.00725, abs=1e-15)
    assert optimizer.param_groups[0]["lr_old"] == 0.05


def test_nag_weight_decay_scales_the_parameter_first():
    """p0 = 2, lr 0.1, wd 0.5, momentum 0.5, gradient 1: p = 2 * (1 - 0.05) - 1.5 * 0.1 = 1.75."""
    param = torch.nn.Parameter(torch.tensor([2.0], dtype=torch.float64))
    optimizer = build_nag(param, 0.1, ["--momentum", "0.5", "--weight-decay", "0.5"])
    step(optimizer, param, 1.0)
    assert param.item() == pytest.approx(1.75, abs=1e-15)


def test_nag_skips_parameters_without_gradient_and_updates_bf16_in_fp32():
    frozen = torch.nn.Parameter(torch.ones(2))
    low = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.bfloat16))
    optimizer = NAG([frozen, low], lr=0.1, momentum=0.9)
    low.grad = torch.tensor([0.5], dtype=torch.bfloat16)
    optimizer.step()
    assert torch.equal(frozen, torch.ones(2)) and frozen not in optimizer.state
    assert low.dtype == torch.bfloat16 and low.item() == pytest.approx(0.905, abs=4e-3)  # bf16 spacing near 1
    assert optimizer.state[low]["momentum_buffer"].dtype == torch.float32


def test_nag_state_dict_round_trip_continues_exactly():
    torch.manual_seed(0)
    grads = [torch.randn(3) for _ in range(5)]
    straight = torch.nn.Parameter(torch.ones(3))
    optimizer = build_nag(straight, 0.2, ["--momentum", "0.9"])
    for i, g in enumerate(grads):
        set_lr(optimizer, 0.2 / (i + 1))
        straight.grad = g.clone()
        optimizer.step()

    resumed = torch.nn.Parameter(torch.ones(3))
    first = build_nag(resumed, 0.2, ["--momentum", "0.9"])
    for i, g in enumerate(grads[:2]):
        set_lr(first, 0.2 / (i + 1))
        resumed.grad = g.clone()
        first.step()
    saved = first.state_dict()
    assert saved["param_groups"][0]["lr_old"] == 0.1 and "momentum_buffer" in saved["state"][0]
    again = torch.nn.Parameter(resumed.detach().clone())
    second = build_nag(again, 0.2, ["--momentum", "0.9"])
    second.load_state_dict(saved)
    for i, g in enumerate(grads[2:], start=2):
        set_lr(second, 0.2 / (i + 1))
        again.grad = g.clone()
        second.step()
    assert torch.equal(again, straight)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--momentum", "1.0"], "--momentum 1.0 must be in"),
        (["--weight-decay", "-1"], "--weight-decay -1.0 is negative"),
    ],
)
def test_nag_bad_flags_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        build_nag(torch.nn.Parameter(torch.zeros(1)), 0.1, argv)


# ----------------------------------------------------------------------------- reduce_lr_on_plateau


def plateau(lr=1.0, **flags):
    cfg = LR_SCHEDULER_REGISTRY.dataclass("reduce_lr_on_plateau")(**flags)
    cfg._name = "reduce_lr_on_plateau"
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)
    lrs = lr if isinstance(lr, list) else [lr]
    return build_lr_scheduler(cfg, optimizer, OptimizationConfig(lr=lrs)), optimizer


def lrs_after_epochs(scheduler, values, first_epoch=1):
    return [scheduler.step(epoch, value) for epoch, value in enumerate(values, start=first_epoch)]


def test_plateau_shrinks_after_an_epoch_without_relative_improvement():
    sched, opt = plateau(1.0, lr_shrink=0.5)  # upstream's defaults: patience 0, threshold 1e-4 (relative)
    assert opt.param_groups[0]["lr"] == 1.0
    # 4.0 < 5 * (1 - 1e-4): better; 4.0 again: worse -> 0.5; 3.9997 > 4 * (1 - 1e-4) = 3.9996: worse -> 0.25
    assert lrs_after_epochs(sched, [5.0, 4.0, 4.0, 3.9997, 3.0, 3.0]) == [1.0, 1.0, 0.5, 0.25, 0.25, 0.125]
    assert sched.step_update(1000) == 0.125  # updates leave it alone after warmup


def test_plateau_patience_counts_bad_epochs_in_a_row():
    sched, _ = plateau(0.8, lr_shrink=0.5, lr_patience=2)
    assert lrs_after_epochs(sched, [3.0, 3.5, 3.2, 3.1, 2.0, 2.5, 2.5, 2.5]) == [0.8, 0.8, 0.8, 0.4, 0.4, 0.4, 0.4, 0.2]


def test_plateau_maximizes_with_maximize_best_checkpoint_metric():
    sched, _ = plateau(1.0, lr_shrink=0.1, maximize_best_checkpoint_metric=True)
    lrs = lrs_after_epochs(sched, [50.0, 60.0, 55.0, 70.0])
    assert lrs == pytest.approx([1.0, 1.0, 0.1, 0.1], rel=1e-12)


def test_plateau_without_a_validation_value_only_counts_the_epoch():
    sched, _ = plateau(1.0, lr_shrink=0.5)
    assert lrs_after_epochs(sched, [None, None, None]) == [1.0, 1.0, 1.0]
    assert sched.state_dict()["last_epoch"] == 3 and sched.state_dict()["best"] == float("inf")


def test_plateau_warmup_is_linear_and_epochs_inside_it_leave_the_rate():
    sched, opt = plateau(1.0, lr_shrink=0.5, warmup_updates=4)  # --warmup-init-lr default: 0 with warmup
    assert [sched.step_update(n) for n in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    sched, _ = plateau(1.0, lr_shrink=0.5, warmup_updates=4, warmup_init_lr=0.2)
    assert sched.step_update(0) == 0.2 and sched.step_update(2) == pytest.approx(0.6, rel=1e-12)
    assert sched.step(1, 5.0) == pytest.approx(0.6, rel=1e-12)  # ends inside warmup: no plateau step
    assert sched.step(2, 9.0) == pytest.approx(0.6, rel=1e-12)
    assert sched.step_update(4) == 1.0 and sched.step_update(5) == 1.0  # warmup over
    assert lrs_after_epochs(sched, [5.0, 5.0], first_epoch=3) == [1.0, 0.5]


def test_plateau_state_dict_resumes_the_same_sequence():
    values = [3.0, 3.5, 2.0, 2.5, 2.5, 2.4, 2.6, 2.6]
    straight, _ = plateau(0.8, lr_shrink=0.5, lr_patience=1)
    expected = lrs_after_epochs(straight, values)
    first, _ = plateau(0.8, lr_shrink=0.5, lr_patience=1)
    got = lrs_after_epochs(first, values[:4])
    saved = first.state_dict()
    assert set(saved) == {"best", "last_epoch", "num_bad_epochs", "cooldown_counter", "lr"}
    second, opt = plateau(0.8, lr_shrink=0.5, lr_patience=1)
    second.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == got[-1]
    got += lrs_after_epochs(second, values[4:], first_epoch=5)
    assert got == expected == [0.8, 0.8, 0.8, 0.8, 0.4, 0.4, 0.2, 0.2]


def test_plateau_loads_upstreams_state():
    sched, _ = plateau(1.0, lr_shrink=0.5)
    sched.load_state_dict({"best": 2.5, "last_epoch": 7})  # what upstream saves
    assert sched.step(8, 2.6) == 0.5 and sched.lr_scheduler.last_epoch == 8


@pytest.mark.parametrize(
    "lr,flags,message",
    [
        ([1.0, 0.5], {}, "reduce_lr_on_plateau takes one learning rate"),
        (1.0, {"lr_shrink": 1.5}, "--lr-shrink 1.5 must be in"),
        (1.0, {"lr_patience": -1}, "--lr-patience -1 is negative"),
    ],
)
def test_plateau_bad_flags_name_the_flag(lr, flags, message):
    with pytest.raises(ValueError, match=message):
        plateau(lr, **flags)


def test_plateau_flags_come_from_the_command_line():
    from fairseq import options

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        [
            "data",
            "--arch",
            "transformer_lm",
            "--optimizer",
            "nag",
            "--momentum",
            "0.95",
            "--lr",
            "1.0",
            "--lr-scheduler",
            "reduce_lr_on_plateau",
            "--lr-shrink",
            "0.5",
            "--lr-patience",
            "2",
            "--lr-threshold",
            "0.01",
            "--warmup-updates",
            "10",
            "--maximize-best-checkpoint-metric",
        ],
    )
    cfg = options.convert_namespace_to_config(args)
    assert (
        cfg.lr_scheduler.lr_shrink,
        cfg.lr_scheduler.lr_patience,
        cfg.lr_scheduler.lr_threshold,
        cfg.lr_scheduler.warmup_updates,
    ) == (0.5, 2, 0.01, 10)
    assert cfg.lr_scheduler.maximize_best_checkpoint_metric is True  # the checkpoint group's flag
    assert cfg.optimizer.momentum == 0.95 and cfg.optimizer.weight_decay == 0.0
