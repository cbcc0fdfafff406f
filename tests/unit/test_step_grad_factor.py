"""fairseq.training.train_step.step_with_grad_factor: the update's gradient factor (fp16 unscaling times the clip
coefficient) is handed to torch's fused optimizers as `grad_scale` (a divisor their kernel applies as it reads each
gradient) and multiplied into the gradients first for every other optimizer; both give the update of the
multiplied gradients."""

import pytest
import torch

from fairseq.training import train_step
from fairseq.optim.adam import build_adamw
from fairseq.training.train_step import step_with_grad_factor

# eps comparable to the gradients' size makes Adam's update depend on their scale (with a tiny eps the first
# step is lr * sign(g) whatever the factor, and the test could not tell a wrong factor from a right one)
HYPER = dict(lr=0.1, betas=(0.9, 0.98), eps=0.5, weight_decay=0.01)


def _must_not_be_called(*args, **kwargs):
    raise AssertionError("the gradients were multiplied before the fused step")


def _params_with_grads(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=generator).requires_grad_() for shape in ((7, 5), (5,), (1000,))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    return params


def _copy(params):
    copies = [p.detach().clone().requires_grad_() for p in params]
    for c, p in zip(copies, params):
        c.grad = p.grad.clone()
    return copies


def _reference_step(params, factor: float, fused: bool):
    for p in params:
        p.grad.mul_(factor)
    torch.optim.AdamW(params, fused=fused, foreach=None if fused else False, **HYPER).step()


@pytest.mark.parametrize("factor", [0.37, 1.0, 4.0])
def test_fused_adamw_applies_the_factor_inside_its_step(factor, monkeypatch):
    params = _params_with_grads()
    expected = _copy(params)
    _reference_step(expected, factor, fused=True)
    optimizer = build_adamw(params, **HYPER)
    assert optimizer.defaults["fused"] and optimizer._step_supports_amp_scaling  # the path under test
    original_grads = [p.grad.clone() for p in params]
    # the gradients must not be multiplied before the step: the kernel does it, given the divisor
    monkeypatch.setattr(train_step, "scale_grads_", _must_not_be_called)
    divisors = []
    real_step = optimizer.step
    monkeypatch.setattr(optimizer, "step", lambda: (divisors.append(optimizer.grad_scale.clone()), real_step()))

    step_with_grad_factor(optimizer, params, torch.tensor(factor, dtype=torch.float64))  # any float dtype

    assert len(divisors) == 1 and divisors[0].dtype == torch.float32
    torch.testing.assert_close(divisors[0], torch.tensor(1.0 / factor))

    assert not hasattr(optimizer, "grad_scale")  # nothing is left for a later step to divide by
    for p, e, g in zip(params, expected, original_grads):
        # the kernel divides by 1/factor where the reference multiplies by factor: one fp32 rounding apart
        torch.testing.assert_close(p.grad, g * factor, rtol=2e-7, atol=0)  # the kernel wrote them back scaled
        torch.testing.assert_close(p.detach(), e.detach(), rtol=1e-6, atol=1e-7)


def test_a_factor_changes_the_update():
    """Guards the test above: with these hyper-parameters a factor of 0.37 moves the parameters elsewhere."""
    params = _params_with_grads()
    scaled, unscaled = _copy(params), _copy(params)
    step_with_grad_factor(build_adamw(scaled, **HYPER), scaled, torch.tensor(0.37))
    step_with_grad_factor(build_adamw(unscaled, **HYPER), unscaled, None)
    assert max((a - b).abs().max().item() for a, b in zip(scaled, unscaled)) > 1e-3


def test_an_optimizer_without_grad_scale_gets_multiplied_gradients():
    params = _params_with_grads()
    expected = _copy(params)
    _reference_step(expected, 0.37, fused=False)
    optimizer = torch.optim.AdamW(params, foreach=False, **HYPER)
    assert not getattr(optimizer, "_step_supports_amp_scaling", False)

    step_with_grad_factor(optimizer, params, torch.tensor(0.37))

    for p, e in zip(params, expected):
        assert torch.equal(p.grad, e.grad)
        assert torch.equal(p.detach(), e.detach())


def test_parameters_without_gradients_are_left_to_the_optimizer():
    params = _params_with_grads()
    frozen = torch.zeros(3, requires_grad=True)  # no .grad: the optimizer skips it, so must the device check
    expected = _copy(params)
    _reference_step(expected, 0.37, fused=True)
    step_with_grad_factor(build_adamw(params + [frozen], **HYPER), params + [frozen], torch.tensor(0.37))
    assert torch.equal(frozen.detach(), torch.zeros(3))
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e.detach(), rtol=1e-6, atol=1e-7)


class _SumOfSquares:
    """A criterion in fairseq's form: (summed loss, sample size, logging output)."""

    def __call__(self, model, sample):
        loss = (model(sample["net_input"]["x"]) ** 2).sum() * 50.0  # large gradients: the clip is exercised
        return loss, sample["ntokens"], {"loss": loss.detach(), "ntokens": sample["ntokens"]}

    def train(self):
        pass


@pytest.mark.parametrize("loss_scale", [8.0, 2.0**15])
def test_loss_scaling_and_clipping_as_one_factor_give_the_unscaled_update(loss_scale):
    """run_update with a loss scaler (fp16's, here over fp32 arithmetic on the CPU) against the same update
    without one: the same gradient norm bit for bit (the norm of scaled gradients over a power-of-two scale is
    exact) and the same parameters to an fp32 rounding (the fused kernel divides by scale / clip coefficient)."""
    from fairseq.dataclass.configs import CommonConfig
    from fairseq.logging.logging_outputs import LoggingOutputSums
    from fairseq.training.precision import DynamicLossScaler, Precision
    from fairseq.training.train_step import run_update

    def update(scaler):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        optimizer = build_adamw(model.parameters(), **HYPER)
        precision = Precision(CommonConfig(), torch.device("cpu"), sharded=False)
        precision.scaler = scaler
        samples = [{"net_input": {"x": torch.randn(4, 6)}, "ntokens": 4} for _ in range(2)]
        norm = run_update(
            model,
            _SumOfSquares(),
            optimizer,
            precision,
            samples,
            LoggingOutputSums(),
            clip_norm=0.5,
            sentence_avg=False,
            device=torch.device("cpu"),
            data_parallel_size=1,
        )
        return norm, [p.detach() for p in model.parameters()]

    plain_norm, plain_params = update(None)
    scaled_norm, scaled_params = update(DynamicLossScaler(init_scale=loss_scale))
    assert plain_norm > 0.5  # clipped
    assert torch.equal(scaled_norm, plain_norm)
    for a, b in zip(scaled_params, plain_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
