"""Adaptive input, adaptive softmax and --criterion adaptive_loss against straightforward reference computations
(in float64: the module and the reference add the same products in different orders, hence 1e-12), upstream's
parameter names and shapes, tying, and the transformer_lm_wiki103 preset."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from fairseq.criterions.adaptive_loss import AdaptiveLoss
from fairseq.models.transformer_lm import TransformerLanguageModel, preset_config
from fairseq.modules.adaptive_input import AdaptiveInput, parse_cutoffs
from fairseq.modules.adaptive_softmax import AdaptiveSoftmax, TiedLinear
from fairseq.generation.sequence_generator import SequenceGenerator

VOCAB, PAD, CUTOFFS = 64, 1, [20, 40]
TOL = dict(rtol=1e-12, atol=1e-12)
TINY = dict(
    decoder_layers=2,
    decoder_embed_dim=32,
    decoder_input_dim=32,
    decoder_output_dim=32,
    decoder_ffn_embed_dim=64,
    decoder_attention_heads=2,
    adaptive_input_cutoff="20,40",
    adaptive_softmax_cutoff="20,40",
    tokens_per_sample=16,
)


def band_of(token, cutoffs):
    return next(i for i, c in enumerate(cutoffs) if token < c)


def all_tokens():
    return torch.arange(VOCAB).view(4, 16)


# ----------------------------------------------------------------------------- adaptive input


def test_adaptive_input_names_shapes_and_upstream_init():
    torch.manual_seed(0)
    emb = AdaptiveInput(VOCAB, PAD, initial_dim=32, factor=4.0, output_dim=24, cutoff=CUTOFFS)
    shapes = {k: tuple(v.shape) for k, v in emb.state_dict().items()}
    assert shapes == {
        "_float_tensor": (1,),
        "embeddings.0.0.weight": (20, 32),
        "embeddings.0.1.weight": (24, 32),
        "embeddings.1.0.weight": (20, 8),
        "embeddings.1.1.weight": (24, 8),
        "embeddings.2.0.weight": (24, 2),
        "embeddings.2.1.weight": (24, 2),
    }
    assert emb.cutoff == [20, 40, 64] and emb.embedding_dim == 24
    for table, _ in emb.embeddings:  # upstream zeroes row padding_idx in every band
        assert torch.equal(table.weight[PAD], torch.zeros(table.weight.size(1)))
    assert emb.embeddings[0][0].padding_idx == PAD and emb.embeddings[1][0].padding_idx is None


def test_adaptive_input_equals_a_lookup_per_band():
    torch.manual_seed(0)
    emb = AdaptiveInput(VOCAB, PAD, 32, 2.0, 24, CUTOFFS).double()
    tokens = all_tokens()
    got = emb(tokens)
    expected = torch.empty(4, 16, 24, dtype=torch.float64)
    for pos, token in enumerate(tokens.view(-1).tolist()):
        band = band_of(token, emb.cutoff)
        start = emb.cutoff[band - 1] if band else 0
        table, projection = emb.weights_for_band(band)
        expected.view(-1, 24)[pos] = projection @ table[token - start]
    torch.testing.assert_close(got, expected, **TOL)


def test_adaptive_input_gradient_stays_in_each_tokens_band():
    torch.manual_seed(0)
    emb = AdaptiveInput(VOCAB, PAD, 16, 4.0, 8, CUTOFFS)
    emb(torch.tensor([[3, 25, 25]])).sum().backward()
    grads = [table.weight.grad for table, _ in emb.embeddings]
    assert grads[0].abs().sum(1).nonzero().view(-1).tolist() == [3]
    assert grads[1].abs().sum(1).nonzero().view(-1).tolist() == [5]
    assert torch.equal(grads[2], torch.zeros_like(grads[2]))  # no token of band 2: zero, not None
    assert emb.embeddings[2][1].weight.grad is not None


@pytest.mark.parametrize(
    "value,message",
    [
        ("20000;60000", "is not a list of integers"),
        ("60000,20000", "must be positive and increasing"),
        ("0,20", "must be positive and increasing"),
    ],
)
def test_cutoff_parsing_errors_name_the_flag(value, message):
    with pytest.raises(ValueError, match=f"--adaptive-input-cutoff '{value}'.*{message}"):
        parse_cutoffs(value, "--adaptive-input-cutoff")


def test_cutoffs_in_upstreams_spellings():
    assert parse_cutoffs("20000,60000", "f") == parse_cutoffs("[20000, 60000]", "f") == [20000, 60000]
    assert parse_cutoffs(20000, "f") == [20000] and parse_cutoffs(None, "f") is None


def test_a_cutoff_beyond_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="--adaptive-input-cutoff 20,80: the last cutoff is larger than the vocab"):
        AdaptiveInput(VOCAB, PAD, 16, 4.0, 8, [20, 80])
    assert AdaptiveInput(VOCAB, PAD, 16, 4.0, 8, [20, 64]).cutoff == [20, 64]  # equal to the vocabulary: allowed


# ----------------------------------------------------------------------------- adaptive softmax


def reference_log_probs(softmax, x):
    """log p(w | x) written out: head log-softmax for band 0, cluster log-prob + tail log-softmax after it."""
    cutoff = softmax.cutoff
    head = F.log_softmax(softmax.head(x), dim=-1)
    out = torch.empty(x.size(0), softmax.vocab_size, dtype=x.dtype)
    for w in range(softmax.vocab_size):
        band = band_of(w, cutoff)
        if band == 0:
            out[:, w] = head[:, w]
        else:
            tail = F.log_softmax(softmax.tail[band - 1](x), dim=-1)
            out[:, w] = head[:, cutoff[0] + band - 1] + tail[:, w - cutoff[band - 1]]
    return out


def test_adaptive_softmax_names_and_shapes_untied():
    sm = AdaptiveSoftmax(VOCAB, 32, CUTOFFS, dropout=0.0, factor=4.0)
    assert {k: tuple(v.shape) for k, v in sm.state_dict().items()} == {
        "head.weight": (22, 32),
        "tail.0.0.weight": (8, 32),
        "tail.0.2.weight": (20, 8),
        "tail.1.0.weight": (2, 32),
        "tail.1.2.weight": (24, 2),
        "version": (1,),
    }
    assert torch.equal(sm.version, torch.LongTensor([1]))


def test_adaptive_softmax_log_probs_equal_the_written_out_formula_and_sum_to_one():
    torch.manual_seed(0)
    sm = AdaptiveSoftmax(VOCAB, 16, CUTOFFS, dropout=0.3, factor=2.0).double().eval()
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    got = sm.get_log_prob(x, target=None)
    assert got.shape == (2, 3, VOCAB) and got.dtype == torch.float64
    expected = reference_log_probs(sm, x.view(-1, 16)).view(2, 3, VOCAB)
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(got.exp().sum(-1), torch.ones(2, 3, dtype=torch.float64), **TOL)
    assert copy.deepcopy(sm).half().get_log_prob(x.half()).dtype == torch.float32  # low precision: upcast
    # a target only narrows upstream's computation; the full distribution comes back either way
    assert torch.equal(sm.get_log_prob(x, target=torch.zeros(2, 3, dtype=torch.long)), got)


def test_adaptive_softmax_training_outputs_follow_upstreams_layout():
    torch.manual_seed(0)
    sm = AdaptiveSoftmax(VOCAB, 16, CUTOFFS, dropout=0.0).double()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    target = torch.tensor([[5, 21, 63, 39, 2]])
    scores, targets = sm(x, target)
    assert targets[0].tolist() == [5, 20, 21, 20, 2]  # band i+1 becomes cluster cutoff[0] + i
    assert targets[1].tolist() == [1, 19] and targets[2].tolist() == [23]
    flat = x.view(-1, 16)
    torch.testing.assert_close(scores[0], sm.head(flat), **TOL)
    torch.testing.assert_close(scores[1], sm.tail[0](flat[[1, 3]]), **TOL)
    torch.testing.assert_close(scores[2], sm.tail[1](flat[[2]]), **TOL)
    # a band without targets still runs, on no rows
    scores, targets = sm(x, torch.tensor([[5, 6, 7, 8, 9]]))
    assert scores[1].shape == (0, 20) and targets[1].numel() == 0


def test_tied_adaptive_softmax_shares_the_adaptive_inputs_parameters():
    emb = AdaptiveInput(VOCAB, PAD, 32, 4.0, 32, CUTOFFS)
    sm = AdaptiveSoftmax(VOCAB, 32, CUTOFFS, 0.0, factor=4.0, adaptive_inputs=emb, tie_proj=True)
    assert sm.head.word_proj.weight is emb.embeddings[0][0].weight
    for i in range(2):
        assert sm.tail[i][0].weight is emb.embeddings[i + 1][1].weight  # used transposed
        assert sm.tail[i][2].weight is emb.embeddings[i + 1][0].weight
    assert set(sm.state_dict()) == {
        "version",
        "head._float_tensor",
        "head.word_proj.weight",
        "head.class_proj.weight",
        "tail.0.0.weight",
        "tail.0.2.weight",
        "tail.1.0.weight",
        "tail.1.2.weight",
    }
    untied_proj = AdaptiveSoftmax(VOCAB, 32, CUTOFFS, 0.0, adaptive_inputs=emb, tie_proj=False)
    assert isinstance(untied_proj.tail[0][0], torch.nn.Linear)
    assert untied_proj.tail[0][0].weight.shape == (8, 32) and isinstance(untied_proj.tail[0][2], TiedLinear)


def test_tied_head_with_other_widths_projects_first():
    emb = AdaptiveInput(VOCAB, PAD, 16, 4.0, 32, CUTOFFS)
    sm = AdaptiveSoftmax(VOCAB, 32, CUTOFFS, 0.0, adaptive_inputs=emb)
    assert {k: tuple(v.shape) for k, v in sm.state_dict().items() if k.startswith("head.word_proj")} == {
        "head.word_proj.0.weight": (16, 32),
        "head.word_proj.1.weight": (20, 16),
    }


# ----------------------------------------------------------------------------- the model and the criterion


def tiny_model(**overrides):
    torch.manual_seed(0)
    cfg = preset_config("transformer_lm_wiki103", **dict(TINY, **overrides))
    return TransformerLanguageModel.build(cfg, VOCAB, PAD)


def sample_of(tokens):
    src = tokens[:, :-1].clone()
    target = tokens[:, 1:].clone()
    return {
        "net_input": {"src_tokens": src, "src_lengths": torch.full((src.size(0),), src.size(1))},
        "target": target,
        "ntokens": int(target.ne(PAD).sum()),
        "nsentences": src.size(0),
    }


class _Task:
    class target_dictionary:
        @staticmethod
        def pad():
            return PAD


def test_wiki103_preset_builds_upstreams_model_with_its_parameter_count():
    with torch.device("meta"):
        model = TransformerLanguageModel.build(
            preset_config("transformer_lm_wiki103", tokens_per_sample=3072), 267744, PAD
        )
    d, ffn = 1024, 4096
    embeddings = 20000 * d + d * d + 40000 * 256 + d * 256 + 207744 * 64 + d * 64
    layer = 4 * d * d + 4 * d + 2 * d * ffn + ffn + d + 2 * 2 * d
    assert sum(p.numel() for p in model.parameters()) == embeddings + 2 * d + 16 * layer == 246_933_504  # "247M"
    dec = model.decoder
    assert dec.layer_norm is None and dec.project_in_dim is None and dec.output_projection is None
    assert model.flops_per_token(3072) is None  # per-band cost depends on the data


def test_model_output_is_log_probabilities_and_get_normalized_probs_keeps_them():
    model = tiny_model().eval()
    tokens = torch.randint(2, VOCAB, (2, 9))
    out = model(tokens)[0]
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(2, 9), rtol=0, atol=1e-5)
    features = model(tokens, features_only=True)[0]
    assert torch.equal(out, model.decoder.adaptive_softmax.get_log_prob(features))
    # log_softmax of log-probabilities returns them up to rounding: the logsumexp it subtracts is 0 give or take
    # an ulp, and an ulp of a log-probability near -20 is 1.9e-6 in fp32, so allow 2 ulps relative
    torch.testing.assert_close(model.get_normalized_probs(out, log_probs=True), out, rtol=2.5e-7, atol=1e-6)
    torch.testing.assert_close(
        model.decoder.get_normalized_probs((out, None), log_probs=False), out.exp(), rtol=0, atol=1e-6
    )


def test_adaptive_loss_is_minus_log_p_of_the_targets_and_logs_like_cross_entropy():
    model = tiny_model().double().eval()
    # 21 = cutoff + padding index: upstream's tails ignore it (their ignore_index), here it counts
    tokens = torch.tensor([[2, 5, 21, 63, 39, 40, 7, PAD, PAD], [3, 21, 21, 4, 50, 19, 20, 22, 9]])
    sample = sample_of(tokens)
    loss, sample_size, log = AdaptiveLoss(_Task(), sentence_avg=False)(model, sample)
    log_probs = model(sample["net_input"]["src_tokens"])[0].double()
    target = sample["target"]
    picked = log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    expected = -(picked * target.ne(PAD)).sum()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)
    assert sample_size == sample["ntokens"] == 14 and log["nsentences"] == 2
    values = AdaptiveLoss.reduce_metrics([log])
    assert values["loss"] == pytest.approx(float(expected.detach()) / 14 / math.log(2), rel=1e-6)
    assert values["ppl"] == pytest.approx(2 ** values["loss"], rel=1e-12)
    per_token, _, _ = AdaptiveLoss(_Task(), sentence_avg=False)(model, sample, reduce=False)
    torch.testing.assert_close(per_token.view_as(target).double(), -picked * target.ne(PAD), rtol=1e-6, atol=1e-9)


def test_every_parameter_gets_a_gradient_when_a_band_has_no_tokens():
    """What DistributedDataParallel (--ddp-backend no_c10d / pytorch_ddp) needs: no unused parameters."""
    model = tiny_model()
    sample = sample_of(torch.tensor([[2, 5, 6, 7, 8, 9, 10, 11]]))  # band 0 only, inputs and targets
    loss, _, _ = AdaptiveLoss(_Task(), sentence_avg=False)(model, sample)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []
    assert torch.equal(
        model.decoder.adaptive_softmax.tail[1][2].weight.grad,
        torch.zeros_like(model.decoder.adaptive_softmax.tail[1][2].weight),
    )


def test_adaptive_loss_needs_an_adaptive_softmax():
    cfg = preset_config(
        "transformer_lm",
        decoder_layers=1,
        decoder_embed_dim=16,
        decoder_input_dim=16,
        decoder_output_dim=16,
        decoder_ffn_embed_dim=16,
        decoder_attention_heads=2,
    )
    model = TransformerLanguageModel.build(cfg, VOCAB, PAD)
    with pytest.raises(ValueError, match="--criterion adaptive_loss needs a model with an adaptive softmax"):
        AdaptiveLoss(_Task(), sentence_avg=False)(model, sample_of(torch.tensor([[2, 5, 6]])))


def test_meta_build_then_reset_reties_and_matches_a_cpu_build():
    cpu_model = tiny_model()
    torch.manual_seed(7)
    cpu_model.reset_parameters()
    with torch.device("meta"):
        meta = TransformerLanguageModel.build(preset_config("transformer_lm_wiki103", **TINY), VOCAB, PAD)
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.reset_parameters()
    dec = meta.decoder
    assert dec.adaptive_softmax.head.word_proj.weight is dec.embed_tokens.embeddings[0][0].weight
    assert dec.adaptive_softmax.tail[1][0].weight is dec.embed_tokens.embeddings[2][1].weight
    expected, got = cpu_model.state_dict(), meta.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


class _Dictionary:
    def pad(self):
        return PAD

    def eos(self):
        return 2

    def unk(self):
        return 3

    def bos(self):
        return 0

    def __len__(self):
        return VOCAB


@torch.no_grad()
def test_greedy_generation_follows_the_full_forwards_argmax():
    model = tiny_model().eval()
    eos, prompt, max_len = 2, [17, 33], 5
    generator = SequenceGenerator([model], _Dictionary(), beam_size=1, max_len_b=max_len, min_len=max_len)
    src = torch.tensor([[eos] + prompt])
    hypo = generator.generate(
        [model],
        {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([3])}},
        prefix_tokens=torch.tensor([prompt]),
    )[0][0]
    seq, expected = [eos], []
    for step in range(max_len + 1):  # prompt, then argmax of a full forward (no </s> before max_len), then </s>
        log_probs = model(torch.tensor([seq]))[0][0, -1].clone()
        log_probs[PAD] = -math.inf
        if step < len(prompt):
            token = prompt[step]
        else:
            log_probs[eos] = -math.inf if step < max_len else log_probs[eos]
            token = eos if step == max_len else int(log_probs.argmax())
        seq.append(token)
        expected.append(float(log_probs[token]))
    assert hypo["tokens"].tolist() == seq[1:]
    torch.testing.assert_close(hypo["positional_scores"], torch.tensor(expected), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(adaptive_input_cutoff="20,50"), "--tie-adaptive-weights needs --adaptive-input-cutoff"),
        (dict(adaptive_softmax_factor=2.0), "--tie-adaptive-weights needs --adaptive-input-factor"),
        (dict(decoder_output_dim=16), "--tie-adaptive-weights needs --decoder-input-dim == --decoder-output-dim"),
        (
            dict(adaptive_softmax_cutoff="1,40", adaptive_input_cutoff="1,40"),
            "--adaptive-input-cutoff 1,40: the first cutoff must be larger than the padding",
        ),
        (dict(adaptive_softmax_cutoff="1,40", tie_adaptive_weights=False), "--adaptive-softmax-cutoff 1,40: the first"),
        (dict(adaptive_input_factor=8.0, adaptive_softmax_factor=8.0), "--adaptive-input-factor 8.0: the bands"),
        (dict(share_decoder_input_output_embed=True), "use --tie-adaptive-weights"),
    ],
)
def test_bad_adaptive_configs_name_the_flag(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_model(**overrides)
