"""--optimizer adam / cpu_adam: torch AdamW with upstream's flags and decoupled weight decay."""

import argparse
import math

import pytest
import torch

from fairseq.dataclass.configs import OptimizationConfig
from fairseq.dataclass.utils import add_dataclass_to_parser, config_from_namespace
from fairseq.optim import build_optimizer
from fairseq.optim.adam import AdamConfig, CPUAdamConfig, parse_adam_betas


def adam_cfg(argv, dc=AdamConfig, name="adam"):
    parser = argparse.ArgumentParser()
    add_dataclass_to_parser(parser, dc)
    return config_from_namespace(dc, parser.parse_args(argv), name)


def hand_written_adamw(param, grads, lr, betas, eps, weight_decay):
    """AdamW as written in Loshchilov & Hutter / torch's docs, in float64, one step per gradient."""
    p = param.clone().double()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    beta1, beta2 = betas
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p - lr * weight_decay * p  # decoupled: not passed through the moments
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        p = p - lr * m_hat / (v_hat.sqrt() + eps)
    return p


def run_steps(optimizer, param, grads):
    for g in grads:
        param.grad = g.clone()
        optimizer.step()


def test_adam_matches_hand_written_adamw_with_weight_decay():
    torch.manual_seed(0)
    start = torch.randn(5, dtype=torch.float64)
    grads = [torch.randn(5, dtype=torch.float64) for _ in range(3)]
    param = torch.nn.Parameter(start.clone())
    cfg = adam_cfg(["--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-6", "--weight-decay", "0.1"])
    optimizer = build_optimizer(cfg, [param], OptimizationConfig(lr=[0.01]))
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.01, (0.9, 0.98), 1e-6, 0.1)
    run_steps(optimizer, param, grads)
    expected = hand_written_adamw(start, grads, 0.01, (0.9, 0.98), 1e-6, 0.1)
    torch.testing.assert_close(param.detach(), expected, rtol=1e-12, atol=1e-14)


def test_weight_decay_is_decoupled_from_the_gradient_moments():
    # With a zero gradient the moments stay 0, so only the decay moves the weight: p * (1 - lr * wd).
    # L2-style decay (grad += wd * p) would instead move it by about lr, normalized by Adam.
    param = torch.nn.Parameter(torch.tensor([2.0, -4.0], dtype=torch.float64))
    cfg = adam_cfg(["--weight-decay", "0.5"])
    optimizer = build_optimizer(cfg, [param], OptimizationConfig(lr=[0.1]))
    run_steps(optimizer, param, [torch.zeros(2, dtype=torch.float64)])
    assert param.detach().tolist() == [2.0 * (1 - 0.1 * 0.5), -4.0 * (1 - 0.1 * 0.5)]


def test_defaults_are_upstreams():
    cfg = adam_cfg([])
    assert (cfg.adam_betas, cfg.adam_eps, cfg.weight_decay) == ("(0.9, 0.999)", 1e-8, 0.0)
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = build_optimizer(cfg, [param], OptimizationConfig())
    group = optimizer.param_groups[0]
    # torch's AdamW defaults weight_decay to 0.01; upstream's flag default 0.0 must win.
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.25, (0.9, 0.999), 1e-8, 0.0)


def test_fused_kernel_used_on_cpu_floats():
    optimizer = build_optimizer(adam_cfg([]), [torch.nn.Parameter(torch.zeros(3))], OptimizationConfig(lr=[1e-3]))
    assert optimizer.defaults["fused"] is True


def test_cpu_adam_is_the_same_adamw_and_accepts_param_groups():
    cfg = adam_cfg(["--adam-betas", "(0.9,0.98)"], CPUAdamConfig, "cpu_adam")
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    groups = [{"params": [a]}, {"params": [b], "weight_decay": 0.0}]
    optimizer = build_optimizer(cfg, groups, OptimizationConfig(lr=[0.0001]))
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [g["betas"] for g in optimizer.param_groups] == [(0.9, 0.98), (0.9, 0.98)]
    assert optimizer.param_groups[1]["params"] == [b]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("(0.9, 0.999)", (0.9, 0.999)),
        ("(0.9,0.98)", (0.9, 0.98)),
        ("0.9, 0.95", (0.9, 0.95)),
        ("[0, 0.5]", (0.0, 0.5)),
        ((0.8, 0.9), (0.8, 0.9)),
    ],
)
def test_parse_adam_betas(text, expected):
    assert parse_adam_betas(text) == expected


@pytest.mark.parametrize(
    "text", ["(0.9)", "0.9 0.98", "(0.9, 0.98, 0.1)", "betas", "(True, 0.9)", "('a', 0.9)", "__import__('os')"]
)
def test_bad_adam_betas_name_the_flag(text):
    with pytest.raises(ValueError, match=r"--adam-betas .*pass it as --adam-betas '\(0.9, 0.98\)'"):
        parse_adam_betas(text)


def test_adam_betas_out_of_range():
    with pytest.raises(ValueError, match=r"--adam-betas '\(0.9, 1.5\)': each beta must be in \[0, 1\)"):
        build_optimizer(
            adam_cfg(["--adam-betas", "(0.9, 1.5)"]), [torch.nn.Parameter(torch.zeros(1))], OptimizationConfig()
        )


def test_unsupported_and_invalid_flags_are_clear_errors():
    params = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError, match="--fp16-adam-stats is not supported"):
        build_optimizer(adam_cfg(["--fp16-adam-stats"]), params, OptimizationConfig())
    with pytest.raises(ValueError, match="--weight-decay -0.1 is negative"):
        build_optimizer(adam_cfg(["--weight-decay", "-0.1"]), params, OptimizationConfig())
    with pytest.raises(ValueError, match="--lr -1.0 is negative"):
        build_optimizer(adam_cfg([]), params, OptimizationConfig(lr=[-1.0]))
    with pytest.raises(ValueError, match="no parameters"):
        build_optimizer(adam_cfg([]), [], OptimizationConfig())
    with pytest.raises(ValueError, match="unknown optimizer 'sgdx' for --optimizer"):
        cfg = adam_cfg([])
        cfg._name = "sgdx"
        build_optimizer(cfg, params, OptimizationConfig())


def test_use_old_adam_is_accepted_and_ignored():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = build_optimizer(adam_cfg(["--use-old-adam"]), [param], OptimizationConfig(lr=[0.5]))
    assert isinstance(optimizer, torch.optim.AdamW)


def test_optimizer_name_from_config_type_when_unnamed():
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    optimizer = build_optimizer(AdamConfig(adam_betas="(0.5, 0.5)"), [param], OptimizationConfig(lr=[1.0]))
    param.grad = torch.ones(1, dtype=torch.float64)
    optimizer.step()
    # First Adam step moves by lr * m_hat / (sqrt(v_hat) + eps) = 1 / (1 + 1e-8).
    assert param.item() == pytest.approx(-1.0 / (1.0 + 1e-8), rel=1e-12)
    assert math.isclose(optimizer.param_groups[0]["betas"][0], 0.5)
