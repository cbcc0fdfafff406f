"""--criterion cross_entropy: summed next-token loss in nats, padding ignored, logged in base 2."""

import math

import pytest
import torch
from torch import nn

from fairseq.criterions import build_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from fairseq.dataclass.configs import OptimizationConfig
from fairseq.logging import metrics

PAD = 1
VOCAB = 7


class PadOnlyDictionary:
    def pad(self):
        return PAD


class TinyTask:
    target_dictionary = PadOnlyDictionary()


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 4)
        self.out = nn.Linear(4, VOCAB)

    def forward(self, src_tokens, src_lengths=None):
        return self.out(self.embed(src_tokens))


def make_sample():
    src = torch.tensor([[0, 4, 5, 6], [0, 6, 4, PAD]])
    target = torch.tensor([[4, 5, 6, 2], [6, 4, 2, PAD]])
    return {
        "id": torch.tensor([0, 1]),
        "nsentences": 2,
        "ntokens": 7,
        "net_input": {"src_tokens": src, "src_lengths": torch.tensor([4, 3])},
        "target": target,
    }


def manual_loss(model, sample):
    logits = model(sample["net_input"]["src_tokens"]).double()  # TinyLM returns the logits alone
    total = 0.0
    for b, row in enumerate(sample["target"].tolist()):
        for t, tok in enumerate(row):
            if tok != PAD:
                total += (torch.logsumexp(logits[b, t], 0) - logits[b, t, tok]).item()
    return total


def test_loss_is_summed_nats_with_padding_ignored():
    model, sample = TinyLM(), make_sample()
    criterion = CrossEntropyCriterion(TinyTask(), sentence_avg=False)
    loss, sample_size, log = criterion(model, sample)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and loss.requires_grad
    assert loss.item() == pytest.approx(manual_loss(model, sample), rel=1e-6)
    assert sample_size == 7
    assert set(log) == {"loss", "ntokens", "nsentences", "sample_size"}
    assert torch.is_tensor(log["loss"]) and not log["loss"].requires_grad
    assert (log["ntokens"], log["nsentences"], log["sample_size"]) == (7, 2, 7)


def test_changing_a_padded_position_does_not_change_the_loss():
    model, sample = TinyLM(), make_sample()
    criterion = CrossEntropyCriterion(TinyTask(), sentence_avg=False)
    before = criterion(model, sample)[0].item()
    sample["net_input"]["src_tokens"][1, 3] = 5  # the input whose target is padding
    assert criterion(model, sample)[0].item() == before


def test_unreduced_loss_is_per_token_with_zero_at_padding():
    model, sample = TinyLM(), make_sample()
    criterion = CrossEntropyCriterion(TinyTask(), sentence_avg=False)
    per_token, _, _ = criterion(model, sample, reduce=False)
    assert per_token.shape == (8,) and per_token[7].item() == 0.0
    assert per_token.sum().item() == pytest.approx(criterion(model, sample)[0].item(), rel=1e-6)


def test_low_precision_logits_are_upcast():
    model, sample = TinyLM().to(torch.bfloat16), make_sample()
    loss, _, _ = CrossEntropyCriterion(TinyTask(), sentence_avg=False)(model, sample)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(manual_loss(model, sample), rel=1e-6)


def test_build_criterion_reads_sentence_avg_from_optimization_group():
    cfg = CrossEntropyCriterionConfig()
    cfg._name = "cross_entropy"
    criterion = build_criterion(cfg, TinyTask(), OptimizationConfig(sentence_avg=True))
    assert isinstance(criterion, CrossEntropyCriterion) and criterion.padding_idx == PAD
    _, sample_size, log = criterion(TinyLM(), make_sample())
    assert sample_size == 2 and log["sample_size"] == 2


def test_reduce_metrics_base2_and_ppl():
    metrics.reset()
    logs = [
        {"loss": torch.tensor(10.0), "ntokens": 4, "nsentences": 1, "sample_size": 4},
        {"loss": torch.tensor(6.0), "ntokens": 4, "nsentences": 1, "sample_size": 4},
    ]
    with metrics.aggregate("train_inner"):
        values = CrossEntropyCriterion.reduce_metrics(logs)
    assert set(values) == {"loss", "ppl"}
    assert values["loss"] == pytest.approx(2.0 / math.log(2), rel=1e-12)  # 16 nats / 8 tokens, in bits
    assert values["ppl"] == pytest.approx(math.e**2, rel=1e-12)
    logged = metrics.get_smoothed_values("train_inner")
    assert logged["loss"] == 2.885 and logged["ppl"] == 7.39  # upstream's rounding: 3 and 2 digits


def test_reduce_metrics_with_sentence_avg_reports_per_token_nll():
    metrics.reset()
    summed = {"loss": 16.0, "ntokens": 8, "nsentences": 2, "sample_size": 2}  # already summed, host numbers
    with metrics.aggregate("train_inner"):
        values = CrossEntropyCriterion.reduce_metrics([summed])
    assert values["loss"] == pytest.approx(8.0 / math.log(2), rel=1e-12)
    assert values["nll_loss"] == pytest.approx(2.0 / math.log(2), rel=1e-12)
    assert values["ppl"] == pytest.approx(math.e**2, rel=1e-12)
    assert metrics.get_smoothed_values("train_inner")["ppl"] == 7.39
    assert CrossEntropyCriterion.logging_outputs_can_be_summed() is True


def test_build_criterion_without_optimization_group_reads_the_config_copy():
    cfg = CrossEntropyCriterionConfig(sentence_avg=True)
    cfg._name = "cross_entropy"
    assert build_criterion(cfg, TinyTask()).sentence_avg is True
    assert build_criterion(cfg, TinyTask(), OptimizationConfig(sentence_avg=False)).sentence_avg is False


# ---------------------------------------------------------------------------- chunked fp32 cross-entropy
from fairseq.criterions.cross_entropy import chunk_rows, token_cross_entropy  # noqa: E402


def _reference(logits, target, ignore_index):
    return torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_elements", [3 * 11, 10**6])  # 3 rows per chunk (a ragged last chunk); one chunk
def test_chunked_cross_entropy_matches_fp32_cross_entropy(dtype, chunk_elements):
    torch.manual_seed(0)
    n, vocab = 10, 11
    logits = (torch.randn(n, vocab) * 3).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (n,))
    target[[2, 7]] = PAD
    weights = torch.rand(n)  # a non-uniform incoming gradient, as reduce=False followed by a weighted sum gives

    losses = token_cross_entropy(logits, target, PAD, chunk_elements=chunk_elements)
    (losses * weights).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    expected = _reference(logits, target, PAD)
    (expected * weights).sum().backward()

    assert losses.dtype == torch.float32
    # Forward: the same fp32 kernel on the same rows, so the per-token values are bitwise equal.
    assert torch.equal(losses, expected)
    assert torch.equal(losses[[2, 7]], torch.zeros(2))
    # Backward: softmax - onehot written directly vs autograd through log_softmax and nll: equal up to fp32
    # rounding before the cast to the logits' dtype, so at most one unit in the last place of that dtype.
    assert grad.dtype == dtype
    tol = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    torch.testing.assert_close(grad.float(), logits.grad.float(), rtol=tol, atol=tol)
    assert torch.equal(grad[[2, 7]], torch.zeros(2, vocab, dtype=dtype))


def test_chunk_rows_bounds_the_fp32_chunk():
    assert chunk_rows(50272) == 2**26 // 50272 == 1334  # 256 MiB of fp32 at GPT-2's vocabulary
    assert chunk_rows(2**30) == 1  # never zero rows
    assert chunk_rows(11, chunk_elements=33) == 3


def test_chunked_cross_entropy_of_no_tokens_is_empty():
    logits = torch.zeros(0, 5, requires_grad=True)
    losses = token_cross_entropy(logits, torch.zeros(0, dtype=torch.long), PAD)
    assert losses.shape == (0,)
    losses.sum().backward()
    assert logits.grad.shape == (0, 5)


def test_a_criterion_not_declaring_summable_logging_outputs_is_built_with_a_warning(caplog):
    from fairseq.criterions import FairseqCriterion, register_criterion

    @register_criterion("unsummable_for_test")
    class Unsummable(FairseqCriterion):  # upstream's default: logging_outputs_can_be_summed() is False
        def __init__(self, cfg, task):
            super().__init__(task)
            self.cfg = cfg

    cfg = CrossEntropyCriterionConfig()
    cfg._name = "unsummable_for_test"
    with caplog.at_level("WARNING"):
        criterion = build_criterion(cfg, TinyTask())
    assert isinstance(criterion, Unsummable) and criterion.cfg is cfg  # upstream passes `cfg` by name
    assert "does not declare logging_outputs_can_be_summed() True" in caplog.text


# --compile's loss. aot_eager traces and differentiates the function as inductor would, without needing a C++
# compiler on the CI machine; inductor itself is checked on CUDA (tests/gpu/test_compiled_loss_gpu.py).
from fairseq.criterions.cross_entropy import _fp32_cross_entropy, compiled_token_cross_entropy  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cross_entropy_matches_the_chunked_one_across_token_counts(dtype):
    torch._dynamo.reset()
    compiled = compiled_token_cross_entropy(backend="aot_eager")
    torch.manual_seed(0)
    for n in (10, 7, 13):  # a new token count recompiles once with a dynamic size; the values stay right
        logits = (torch.randn(n, 11) * 3).to(dtype).requires_grad_()
        target = torch.randint(0, 11, (n,))
        target[[2, 5]] = PAD
        weights = torch.rand(n)
        losses = compiled(logits, target, PAD)
        (losses * weights).sum().backward()
        grad, logits.grad = logits.grad.clone(), None
        expected = token_cross_entropy(logits, target, PAD)
        (expected * weights).sum().backward()
        assert losses.dtype == torch.float32 and grad.dtype == dtype
        # Both are fp32 log-softmax of the same values; the traced one is decomposed into separate ops, so
        # fp32 rounding may differ: a few ulps of values of order 10.
        torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-5)
        assert torch.equal(losses[[2, 5]], torch.zeros(2))
        tol = {torch.float32: 1e-6, torch.bfloat16: 2**-8}[dtype]  # one unit in the last place of the dtype
        torch.testing.assert_close(grad.float(), logits.grad.float(), rtol=tol, atol=tol)
        assert torch.equal(grad[[2, 5]], torch.zeros(2, 11, dtype=dtype))


def test_criterion_compile_loss_gives_the_same_loss_and_gradients():
    torch._dynamo.reset()
    sample = make_sample()
    eager_model, compiled_model = TinyLM(), TinyLM()
    eager = CrossEntropyCriterion(TinyTask(), sentence_avg=False)
    compiled = CrossEntropyCriterion(TinyTask(), sentence_avg=False)
    compiled.compile_loss(backend="aot_eager")
    loss_eager, size_eager, _ = eager(eager_model, sample)
    loss_compiled, size_compiled, _ = compiled(compiled_model, sample)
    loss_eager.backward()
    loss_compiled.backward()
    assert size_eager == size_compiled == 7
    assert loss_compiled.item() == pytest.approx(loss_eager.item(), rel=1e-6)
    torch.testing.assert_close(compiled_model.out.weight.grad, eager_model.out.weight.grad, rtol=1e-5, atol=1e-7)


def test_trainer_compiles_the_loss_only_with_compile():
    from fairseq import options, tasks
    from fairseq.training.trainer import Trainer

    def trainer(extra):
        argv = [
            "--task",
            "dummy_lm",
            "--tokens-per-sample",
            "8",
            "--arch",
            "transformer_lm",
            "--decoder-layers",
            "1",
            "--decoder-embed-dim",
            "8",
            "--decoder-ffn-embed-dim",
            "16",
            "--decoder-attention-heads",
            "2",
            "--cpu",
            "--optimizer",
            "adam",
            "--lr",
            "1e-3",
            *extra,
        ]
        cfg = options.convert_namespace_to_config(options.parse_args_and_arch(options.get_training_parser(), argv))
        task = tasks.setup_task(cfg.task)
        return Trainer(cfg, task, task.build_model(cfg.model), build_criterion(cfg.criterion, task, cfg.optimization))

    assert trainer([]).criterion._token_loss is token_cross_entropy
    # the CPU has no fused kernels: --compile's loss runs the compiled fp32 cross-entropy
    assert trainer(["--compile"]).criterion._token_loss.fallback._torchdynamo_orig_callable is _fp32_cross_entropy
