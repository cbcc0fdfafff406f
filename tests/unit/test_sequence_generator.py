"""SequenceGenerator on tiny real models: greedy and beam search against plain references computed with full
forwards (no cache), scores, length limits, prompts, sampling, batching independence, plug-in decoders, and
the task's inference methods."""

import argparse
import math

import pytest
import torch
import torch.nn as nn

from fairseq import options

from fairseq.generation import search
from fairseq.generation.cuda_graph_decoding import round_up_sentences
from fairseq.data.dictionary import Dictionary
from fairseq.models import BaseFairseqModel, FairseqDecoder, FairseqIncrementalDecoder
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig
from fairseq.modules import CausalSelfAttention
from fairseq.generation.sequence_generator import SequenceGenerator
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

# Scores are sums of fp32 log-probabilities from two computations of the same function (cached one token at a
# time vs one full forward); they agree to ~1e-6.
ATOL = 2e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread


def make_dictionary(words=8):
    d = Dictionary()
    for i in range(words):
        d.add_symbol(f"w{i}")
    return d


D = make_dictionary()
V, BOS, PAD, EOS, UNK = len(D), D.bos(), D.pad(), D.eos(), D.unk()
W = [D.index(f"w{i}") for i in range(8)]


def build(seed=0, **overrides):
    options = dict(
        decoder_embed_dim=16,
        decoder_input_dim=16,
        decoder_output_dim=16,
        decoder_ffn_embed_dim=32,
        decoder_layers=2,
        decoder_attention_heads=2,
        max_target_positions=64,
        dropout=0.0,
        decoder_learned_pos=True,
        decoder_normalize_before=True,
    )
    options.update(overrides)
    torch.manual_seed(seed)
    return TransformerLanguageModel.build(TransformerLanguageModelConfig(**options), V, PAD).eval()


def unigram_model(logits):
    """A real transformer whose final layer norm is set to emit one constant vector: every step predicts
    softmax(`logits`), whatever came before."""
    model = build()
    with torch.no_grad():
        norm, out = model.decoder.layer_norm, model.decoder.output_projection
        norm.weight.zero_()
        norm.bias.zero_()
        norm.bias[0] = 1.0
        out.weight.zero_()
        out.weight[:, 0] = torch.tensor(logits, dtype=torch.float32)
    return model


def logits_with(**values):
    index = {"eos": EOS, "unk": UNK, **{f"w{i}": W[i] for i in range(8)}}
    logits = [0.0] * V
    for name, value in values.items():
        logits[index[name]] = value
    return logits


def sample_of(prompts):
    """A batch as task.build_dataset_for_inference lays it out: </s> + prompt, right-padded."""
    width = 1 + max(len(p) for p in prompts)
    src = torch.full((len(prompts), width), PAD)
    prefix = torch.full((len(prompts), width - 1), PAD)
    for i, p in enumerate(prompts):
        src[i, 0] = EOS
        src[i, 1 : 1 + len(p)] = torch.tensor(p, dtype=torch.long)
        prefix[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return {"net_input": {"src_tokens": src, "src_lengths": (src != PAD).sum(1)}}, prefix


def generate(model, prompts, models=None, **kwargs):
    generator = SequenceGenerator(models or [model], D, **kwargs)
    sample, prefix = sample_of(prompts)
    return generator.generate(models or [model], sample, prefix_tokens=prefix)


@torch.no_grad()
def full_log_probs(model, seq, temperature=1.0):
    """log-softmax of a full forward (no cache) after `seq` (a list starting with the bos token)."""
    out = model(torch.tensor([seq]))
    logits = out[0] if isinstance(out, tuple) else out
    return torch.log_softmax(logits[0, -1].float() / temperature, dim=-1)


def reference_greedy(model, prompt, max_len, min_len=1, unkpen=0.0, temperature=1.0):
    seq, scores = [EOS], []
    for step in range(max_len + 1):
        lp = full_log_probs(model, seq, temperature)
        lp[PAD] = -math.inf
        lp[UNK] -= unkpen
        if step < len(prompt):
            token = prompt[step]
        else:
            if step < min_len:
                lp[EOS] = -math.inf
            token = EOS if step == max_len else int(lp.argmax())
        seq.append(token)
        scores.append(float(lp[token]))
        if token == EOS:
            break
    return seq[1:], scores


def reference_beam(model, prompt, beam, max_len, min_len=1, lenpen=1.0):
    """Upstream's beam search written plainly: every live hypothesis extended by every token (full forwards),
    the 2 * beam best candidates; those ending with </s> among the beam best are done, the first beam others
    live on; a sentence ends with beam done hypotheses or at the last step."""
    live, done = [([], 0.0, [])], []
    for step in range(max_len + 1):
        candidates = []
        for i, (toks, score, _) in enumerate(live):
            lp = full_log_probs(model, [EOS] + toks)
            lp[PAD] = -math.inf
            allowed = range(V)
            if step >= max_len:
                allowed = [EOS]
            elif step < len(prompt):
                allowed = [prompt[step]]
            elif step < min_len:
                lp[EOS] = -math.inf
            candidates += [(score + float(lp[t]), i, t, float(lp[t])) for t in allowed if lp[t] > -math.inf]
        candidates.sort(key=lambda c: -c[0])
        next_live = []
        for rank, (score, i, token, lp) in enumerate(candidates[: 2 * beam]):
            toks, _, pos = live[i]
            if token == EOS:
                if rank < beam and len(done) < beam:
                    done.append((toks + [EOS], score / (len(toks) + 1) ** lenpen, pos + [lp]))
            elif len(next_live) < beam:
                next_live.append((toks + [token], score, pos + [lp]))
        if len(done) >= beam or step == max_len:
            break
        live = next_live
    return sorted(done, key=lambda h: -h[1])


@torch.no_grad()
def sequence_log_probs(model, seq):
    """[len(seq), V]: log-softmax of one full forward over `seq`, row i predicting the token after seq[:i + 1]."""
    out = model(torch.tensor([seq]))
    logits = out[0] if isinstance(out, tuple) else out
    return torch.log_softmax(logits[0].float(), dim=-1)


def check_positional_scores(model, hypo):
    toks = hypo["tokens"].tolist()
    expected = sequence_log_probs(model, [EOS] + toks[:-1]).gather(1, torch.tensor(toks).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(hypo["positional_scores"], expected, atol=ATOL, rtol=0)


PROMPTS = [[W[0], W[1], W[2], W[3]], [W[4]], [W[5], W[6], W[7]], []]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_greedy_is_the_argmax_of_full_forwards(temperature):
    model = build()
    hypos = generate(model, PROMPTS, beam_size=1, max_len_b=12, temperature=temperature)
    for prompt, sentence in zip(PROMPTS, hypos):
        assert len(sentence) == 1
        hypo = sentence[0]
        tokens, scores = reference_greedy(model, prompt, max_len=12, temperature=temperature)
        assert hypo["tokens"].tolist() == tokens
        assert hypo["tokens"][: len(prompt)].tolist() == prompt and hypo["tokens"][-1] == EOS
        torch.testing.assert_close(hypo["positional_scores"], torch.tensor(scores), atol=ATOL, rtol=0)
        assert set(hypo) == {"tokens", "score", "attention", "alignment", "positional_scores"}
        assert hypo["attention"] is None and hypo["alignment"].numel() == 0
        torch.testing.assert_close(hypo["score"], hypo["positional_scores"].sum() / len(tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("lenpen", [1.0, 0.5, 2.0])
def test_beam_search_matches_a_plain_reference_beam_search(lenpen):
    model = build(seed=3)
    for prompt in ([W[2], W[5]], []):
        hypos = generate(model, [prompt], beam_size=4, max_len_b=6, len_penalty=lenpen)[0]
        expected = reference_beam(model, prompt, beam=4, max_len=6, lenpen=lenpen)
        assert [h["tokens"].tolist() for h in hypos] == [e[0] for e in expected]
        for hypo, (tokens, score, positional) in zip(hypos, expected):
            torch.testing.assert_close(float(hypo["score"]), score, atol=ATOL, rtol=0)
            torch.testing.assert_close(hypo["positional_scores"], torch.tensor(positional), atol=ATOL, rtol=0)
            check_positional_scores(model, hypo)
            # The normalized score: summed log-probabilities over len(tokens) ** lenpen; best first.
            torch.testing.assert_close(
                float(hypo["score"]), float(hypo["positional_scores"].sum()) / len(tokens) ** lenpen, atol=ATOL, rtol=0
            )
        assert [float(h["score"]) for h in hypos] == sorted((float(h["score"]) for h in hypos), reverse=True)


def test_unnormalized_scores_are_sums():
    model = build(seed=3)
    for hypo in generate(model, [[W[1]]], beam_size=3, max_len_b=5, normalize_scores=False)[0]:
        torch.testing.assert_close(float(hypo["score"]), float(hypo["positional_scores"].sum()), atol=ATOL, rtol=0)


def test_min_len_blocks_eos_before_it_and_generation_stops_at_eos():
    model = unigram_model(logits_with(eos=5.0, w3=4.0))
    lp = torch.log_softmax(torch.tensor(logits_with(eos=5.0, w3=4.0)), -1)
    assert generate(model, [[]], max_len_b=10, min_len=0)[0][0]["tokens"].tolist() == [EOS]
    assert generate(model, [[]], max_len_b=10)[0][0]["tokens"].tolist() == [W[3], EOS]  # upstream's default 1
    hypo = generate(model, [[]], max_len_b=10, min_len=3)[0][0]
    assert hypo["tokens"].tolist() == [W[3], W[3], W[3], EOS]
    torch.testing.assert_close(hypo["positional_scores"], lp[[W[3], W[3], W[3], EOS]], atol=1e-6, rtol=0)
    # Prompts of different lengths: the short one ends (and leaves the batch) while the long one is forced;
    # --min-len applies to a row as soon as its prompt is over.
    hypos = generate(model, [[W[1]], [W[1], W[2], W[4], W[5]]], max_len_b=10, min_len=2)
    assert hypos[0][0]["tokens"].tolist() == [W[1], W[3], EOS]
    assert hypos[1][0]["tokens"].tolist() == [W[1], W[2], W[4], W[5], EOS]


def test_unk_penalty():
    logits = logits_with(unk=5.0, w3=4.0, eos=-10.0)
    model = unigram_model(logits)
    lp = torch.log_softmax(torch.tensor(logits), -1)
    assert generate(model, [[]], max_len_b=3)[0][0]["tokens"].tolist() == [UNK, UNK, UNK, EOS]
    assert generate(model, [[]], max_len_b=3, unk_penalty=2.0)[0][0]["tokens"].tolist() == [W[3]] * 3 + [EOS]
    hypo = generate(model, [[]], max_len_b=3, unk_penalty=0.5)[0][0]
    assert hypo["tokens"].tolist() == [UNK] * 3 + [EOS]
    torch.testing.assert_close(hypo["positional_scores"][:3], (lp[UNK] - 0.5).repeat(3), atol=1e-6, rtol=0)
    tokens, _ = reference_greedy(model, [], max_len=3, unkpen=2.0)
    assert tokens == [W[3]] * 3 + [EOS]


def test_max_len_a_b_and_the_models_positions():
    model = build(max_target_positions=10)
    sample, prefix = sample_of([[W[1], W[2], W[3]]])  # src_tokens is 4 wide
    # min_len = max_len keeps </s> out until the last step, so the output length is max_len + 1.
    for a, b, max_len in ((0, 5, 5), (1.5, 2, 8), (0, 100, 9)):  # the last one: 10 positions - 1
        generator = SequenceGenerator([model], D, beam_size=2, max_len_a=a, max_len_b=b, min_len=max_len)
        hypos = generator.generate([model], sample, prefix_tokens=prefix)[0]
        assert {len(h["tokens"]) for h in hypos} == {max_len + 1}
    generator = SequenceGenerator([model], D, max_len_b=3, min_len=4)
    with pytest.raises(ValueError, match="--min-len 4 is larger than the longest output allowed, 3"):
        generator.generate([model], sample, prefix_tokens=prefix)


def test_prompts_that_do_not_fit_raise_one_clear_error():
    model = build(max_target_positions=8)
    generator = SequenceGenerator([model], D, max_len_b=200)
    sample, prefix = sample_of([[W[1]] * 8, [W[2]]])
    with pytest.raises(
        ValueError,
        match=r"a prompt of 8 tokens does not fit.* shorten the prompts to 7 tokens or less "
        r"\(fairseq-generate: a smaller --tokens-per-sample, or --prefix-size N\)",
    ):
        generator.generate([model], sample, prefix_tokens=prefix)
    with pytest.raises(ValueError, match="--temperature must be greater than 0"):
        SequenceGenerator([model], D, temperature=0)


def test_a_prompt_longer_than_the_output_allowed_is_cut_there_as_upstream_does(caplog):
    """Upstream forces the prompt until max_len tokens, then </s>: the prompt's first max_len tokens (said once)."""
    model = build(max_target_positions=16)
    generator = SequenceGenerator([model], D, beam_size=2, max_len_b=3)
    sample, prefix = sample_of([[W[1]] * 5, [W[2], W[3]]])
    for _ in range(2):
        hypos = generator.generate([model], sample, prefix_tokens=prefix)
        assert hypos[0][0]["tokens"].tolist() == [W[1]] * 3 + [D.eos()]
        assert hypos[1][0]["tokens"][:2].tolist() == [W[2], W[3]] and len(hypos[1][0]["tokens"]) <= 4
    warnings = [r.getMessage() for r in caplog.records if "longer than the longest output allowed" in r.getMessage()]
    assert (
        len(warnings) == 1
        and warnings[0].startswith("a prompt of 5 tokens is longer than the longest output allowed, 3 tokens")
        and "raise --max-len-b" in warnings[0]
    )


@pytest.mark.parametrize("beam", [1, 3])
def test_a_prompts_continuation_does_not_depend_on_its_batch(beam):
    model = build(seed=1)
    batched = generate(model, PROMPTS, beam_size=beam, max_len_b=10)
    for prompt, together in zip(PROMPTS, batched):
        alone = generate(model, [prompt], beam_size=beam, max_len_b=10)[0]
        assert [h["tokens"].tolist() for h in together] == [h["tokens"].tolist() for h in alone]
        for a, b in zip(together, alone):
            torch.testing.assert_close(a["positional_scores"], b["positional_scores"], atol=ATOL, rtol=0)
            assert a["tokens"][: len(prompt)].tolist() == prompt


class StepwiseBeamSearch(search.BeamSearch):
    forced_beams = None  # unknown to the generator: every prompt token goes through step()


def test_feeding_shared_prompts_at_once_equals_forcing_them_step_by_step():
    model = build(seed=2)
    prompts = [[W[1], W[2], W[3]], [W[4], W[5], W[6], W[7]]]
    at_once = generate(model, prompts, beam_size=3, max_len_b=9)
    stepwise = generate(model, prompts, beam_size=3, max_len_b=9, search_strategy=StepwiseBeamSearch(D))
    for a, b in zip(at_once, stepwise):
        assert [h["tokens"].tolist() for h in a] == [h["tokens"].tolist() for h in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(x["positional_scores"], y["positional_scores"], atol=ATOL, rtol=0)


def test_sampling_is_reproducible_and_stays_in_the_top_k_or_top_p():
    model = build(seed=4)
    prompts = [[W[1], W[2]], [W[3]]]

    def draw(seed, **kwargs):
        torch.manual_seed(seed)
        hypos = generate(model, prompts, beam_size=3, max_len_b=8, search_strategy=search.Sampling(D, **kwargs))
        return hypos, [[h["tokens"].tolist() for h in sentence] for sentence in hypos]

    for kwargs in (dict(sampling_topk=3), dict(sampling_topp=0.5), {}):
        hypos, tokens = draw(7, **kwargs)
        assert draw(7, **kwargs)[1] == tokens
        assert draw(8, **kwargs)[1] != tokens
        assert all(len(sentence) == 3 for sentence in hypos)  # every beam draws its own sample
        for prompt, sentence in zip(prompts, hypos):
            for hypo in sentence:
                check_positional_scores(model, hypo)
                toks = hypo["tokens"].tolist()
                assert toks[: len(prompt)] == prompt
                all_lp = sequence_log_probs(model, [EOS] + toks[:-1])
                for i in range(len(prompt), len(toks) - 1):
                    lp = all_lp[i].clone()
                    lp[PAD] = -math.inf
                    if "sampling_topk" in kwargs:
                        assert toks[i] in lp.topk(3).indices.tolist()
                    elif "sampling_topp" in kwargs:  # the tokens more likely than it hold less than p
                        assert float(lp.exp()[lp > lp[toks[i]]].sum()) < 0.5


def test_no_repeat_ngram_size():
    model = build(seed=5)
    for hypo in generate(model, [[W[1]], []], beam_size=2, max_len_b=30, no_repeat_ngram_size=2)[0]:
        seq = [EOS] + hypo["tokens"].tolist()
        bigrams = list(zip(seq, seq[1:]))
        assert len(bigrams) == len(set(bigrams))


def test_the_kv_cache_is_allocated_once_per_generate(monkeypatch):
    allocations = []
    original = CausalSelfAttention._ensure_capacity

    def spy(self, entry, rows, length, like):
        before = entry["key_buffer"]
        original(self, entry, rows, length, like)
        if entry["key_buffer"] is not before:
            allocations.append((id(self), tuple(entry["key_buffer"].shape)))

    monkeypatch.setattr(CausalSelfAttention, "_ensure_capacity", spy)
    model = build(seed=1)
    generate(model, PROMPTS, beam_size=3, max_len_b=10)  # beams reordered, sentences dropped
    # One buffer per layer (keys and values together), at batch 4 x beam 3 rows and max_len + 1 = 11 slots.
    assert sorted(shape for _, shape in allocations) == [(12, 2, 11, 8)] * 2
    assert len({layer for layer, _ in allocations}) == 2


class GRUDecoder(FairseqIncrementalDecoder):
    """An upstream-style plug-in: returns (logits, extra) and, with a state, computes only the last token."""

    def __init__(self, dictionary, dim=12):
        super().__init__(dictionary)
        torch.manual_seed(6)
        self.embed = nn.Embedding(len(dictionary), dim)
        self.cell = nn.GRUCell(dim, dim)
        self.out = nn.Linear(dim, len(dictionary))

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        if incremental_state is not None:
            cached = self.get_incremental_state(incremental_state, "hidden")
            hidden = None if cached is None else cached["hidden"]
            hidden = self.cell(self.embed(prev_output_tokens[:, -1]), hidden)
            self.set_incremental_state(incremental_state, "hidden", {"hidden": hidden})
            return hidden.unsqueeze(1), {"attn": [None]}
        hidden, states = None, []
        for t in range(prev_output_tokens.size(1)):
            hidden = self.cell(self.embed(prev_output_tokens[:, t]), hidden)
            states.append(hidden)
        return torch.stack(states, dim=1), {"attn": [None]}

    def output_layer(self, features, **kwargs):
        return self.out(features)

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        features, extra = self.extract_features(prev_output_tokens, incremental_state=incremental_state)
        return self.output_layer(features), extra

    def reorder_incremental_state(self, incremental_state, new_order):
        cached = self.get_incremental_state(incremental_state, "hidden")
        if cached is not None:
            self.set_incremental_state(
                incremental_state, "hidden", {"hidden": cached["hidden"].index_select(0, new_order)}
            )


class CachelessGRUDecoder(FairseqDecoder):
    """The same network without a cache: the generator re-runs the whole prefix each step."""

    def __init__(self, incremental):
        super().__init__(incremental.dictionary)
        self.net = incremental

    def forward(self, prev_output_tokens, encoder_out=None, **kwargs):
        return self.net(prev_output_tokens)


class PluginLM(BaseFairseqModel):
    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, src_tokens, **kwargs):
        return self.decoder(src_tokens)


def test_plug_in_decoders_returning_logits_and_extra():
    incremental = PluginLM(GRUDecoder(D)).eval()
    cacheless = PluginLM(CachelessGRUDecoder(incremental.decoder)).eval()
    hypos = generate(incremental, PROMPTS, beam_size=3, max_len_b=7)
    for prompt, sentence in zip(PROMPTS, hypos):
        expected = reference_beam(incremental, prompt, beam=3, max_len=7)
        assert [h["tokens"].tolist() for h in sentence] == [e[0] for e in expected]
        for hypo in sentence:
            check_positional_scores(incremental, hypo)
    again = generate(cacheless, PROMPTS, beam_size=3, max_len_b=7)
    assert [[h["tokens"].tolist() for h in s] for s in again] == [[h["tokens"].tolist() for h in s] for s in hypos]


def test_an_ensemble_averages_probabilities():
    models = [build(seed=7), build(seed=8)]
    hypo = generate(None, [[W[2]]], models=models, max_len_b=8)[0][0]
    toks = hypo["tokens"].tolist()
    averaged = torch.logsumexp(torch.stack([sequence_log_probs(m, [EOS] + toks[:-1]) for m in models]), 0)
    averaged = averaged - math.log(2)
    averaged[:, PAD] = -math.inf
    for i in range(1, len(toks)):  # greedy over the averaged distribution, </s> forced at max_len = 8
        assert toks[i] == (EOS if i == 8 else int(averaged[i].argmax()))
    torch.testing.assert_close(
        hypo["positional_scores"], averaged.gather(1, torch.tensor(toks).unsqueeze(1)).squeeze(1), atol=ATOL, rtol=0
    )


# ---- the static one-token step (what CUDA graphs capture, tests/gpu), run eagerly -------------------------


class EagerStaticGenerator(SequenceGenerator):
    """The CUDA-graph path but the capture itself: every step runs the static step on the runner's buffers,
    rows rounded up, caches kept from one call to the next."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"device_loop": True, **kwargs})
        self.step_model.eager_graphs = True


def assert_same_hypotheses(got, expected):
    assert [[h["tokens"].tolist() for h in s] for s in got] == [[h["tokens"].tolist() for h in s] for s in expected]
    for got_sentence, expected_sentence in zip(got, expected):
        for a, b in zip(got_sentence, expected_sentence):
            torch.testing.assert_close(a["positional_scores"], b["positional_scores"], atol=ATOL, rtol=0)
            torch.testing.assert_close(float(a["score"]), float(b["score"]), atol=ATOL, rtol=0)


def cache_pointers(states):
    return [entry["key_buffer"].data_ptr() for state in states for entry in state.values() if "key_buffer" in entry]


@pytest.mark.parametrize(
    "beam,sampling,options",
    [
        (1, None, dict(unk_penalty=0.5)),
        (1, None, dict(min_len=6)),
        (3, None, dict(no_repeat_ngram_size=2)),
        (2, dict(sampling_topk=4), {}),
        (2, dict(sampling_topp=0.8), dict(temperature=0.8)),
    ],
)
def test_the_static_step_path_gives_the_eager_paths_hypotheses(beam, sampling, options):
    model = build(seed=4)  # its sentences end at different steps
    generators = [
        cls(
            [model],
            D,
            beam_size=beam,
            max_len_b=12,
            search_strategy=None if sampling is None else search.Sampling(D, **sampling),
            **options,
        )
        for cls in (SequenceGenerator, EagerStaticGenerator)
    ]
    static = generators[1]
    # Then fewer sentences (the caches are reused, rows past the live ones computed and ignored), then more
    # (a new, larger cache; 6 sentences run as 8).
    for call, prompts in enumerate((PROMPTS, PROMPTS[1:3], PROMPTS + [[W[6]] * 3, [W[2]]])):
        sample, prefix = sample_of(prompts)
        results = []
        for generator in generators:
            torch.manual_seed(call)
            results.append(generator.generate([model], sample, prefix_tokens=prefix))
        assert_same_hypotheses(results[1], results[0])
        if call == 0:
            if beam == 1 and "min_len" not in options:
                assert len({len(sentence[0]["tokens"]) for sentence in results[0]}) > 1
            pointers, rows = cache_pointers(static.step_model.graphed.states), static.step_model.graphed.rows
        assert (cache_pointers(static.step_model.graphed.states) == pointers) == (call < 2)
    assert (rows, static.step_model.graphed.rows, static.step_model.graphed.capacity) == (4 * beam, 8 * beam, 64)


def test_cuda_graphs_are_for_cuda_and_this_forks_decoders_only():
    assert [round_up_sentences(n) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 24, 32]
    generator = SequenceGenerator([build()], D)
    assert generator.model.can_static_step and generator.cuda_graphs
    assert generator.step_model.graph_runner(torch.device("cpu")) is None
    assert not SequenceGenerator([PluginLM(GRUDecoder(D)).eval()], D).model.can_static_step
    # a decoder with the static step but without both block-table methods (beam search reorders through them)
    # keeps the path without graphs (only take_parent_blocks was checked: set_block_table failed at a beam batch)
    model = build()

    def absent(self):
        raise AttributeError("set_block_table")

    model.decoder.__class__ = type("NoBlockTable", (type(model.decoder),), {"set_block_table": property(absent)})
    assert hasattr(model.decoder, "take_parent_blocks") and not hasattr(model.decoder, "set_block_table")
    assert not SequenceGenerator([model], D).model.can_static_step


def host_syncs(generator, prompts):
    sample, prefix = sample_of(prompts)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        generator.generate(None, sample, prefix_tokens=prefix)
    return sum(event.name == "aten::_local_scalar_dense" for event in profile.events())  # bool(t), int(t)


def test_one_host_sync_per_step_and_none_while_eos_is_masked():
    """The step-by-step loop's (beam search runs on the device otherwise: tests/unit/test_device_beam_search.py)."""
    model = unigram_model(logits_with(w3=4.0, eos=-10.0))  # never ends before the length limit
    prompts = [[W[1]], [W[2], W[3]]]

    def syncs(max_len, min_len):
        return host_syncs(
            SequenceGenerator([model], D, beam_size=2, max_len_b=max_len, min_len=min_len, device_loop=False), prompts
        )

    assert syncs(16, 1) - syncs(8, 1) == 8
    assert syncs(16, 16) == syncs(8, 8)


# ---- the task's inference methods --------------------------------------------------------------------------


def lm_task(add_bos_token=False):
    return LanguageModelingTask(LanguageModelingConfig(add_bos_token=add_bos_token), D)


@pytest.mark.parametrize("add_bos_token", [False, True])
def test_task_inference_dataset_and_step(add_bos_token):
    task = lm_task(add_bos_token)
    start = BOS if add_bos_token else EOS
    lines = [torch.tensor([W[1], W[2], EOS]), torch.tensor([W[3], EOS])]
    dataset = task.build_dataset_for_inference(lines, [len(t) for t in lines])
    batch = dataset.collater([dataset[0], dataset[1]])
    assert batch["net_input"]["src_tokens"].tolist() == [[start, W[1], W[2]], [start, W[3], PAD]]
    assert batch["net_input"]["src_lengths"].tolist() == [3, 2]
    assert batch["target"].tolist() == [[W[1], W[2], PAD], [W[3], PAD, PAD]]
    assert batch["id"].tolist() == [0, 1]

    model = build(seed=9)
    generator = task.build_generator([model], argparse.Namespace(beam=2, max_len_b=6))
    itr = task.get_batch_iterator(dataset, max_sentences=2).next_epoch_itr(shuffle=False)
    for sample in itr:
        hypos = task.inference_step(generator, [model], sample)
        for i, sentence in zip(sample["id"].tolist(), hypos):
            prompt = lines[i][:-1]
            direct = generator.generate(
                [model], sample, prefix_tokens=sample["net_input"]["src_tokens"][:, 1:], bos_token=start
            )[sample["id"].tolist().index(i)]
            assert [h["tokens"].tolist() for h in sentence] == [h["tokens"].tolist() for h in direct]
            assert sentence[0]["tokens"][: len(prompt)].tolist() == prompt.tolist()
    with pytest.raises(ValueError, match="--constraints"):
        task.inference_step(generator, [model], sample, constraints=torch.zeros(1))


def test_build_generator_reads_upstreams_options_and_rejects_what_upstream_rejects():
    task = lm_task()
    model = build()
    generator = task.build_generator(
        [model],
        argparse.Namespace(
            beam=3,
            max_len_a=0.5,
            max_len_b=7,
            min_len=2,
            lenpen=0.7,
            unkpen=1.5,
            temperature=0.9,
            no_repeat_ngram_size=3,
            unnormalized=True,
        ),
    )
    assert (generator.beam_size, generator.max_len_a, generator.max_len_b, generator.min_len) == (3, 0.5, 7, 2)
    assert (generator.len_penalty, generator.unk_penalty, generator.temperature) == (0.7, 1.5, 0.9)
    assert generator.no_repeat_ngram_size == 3 and not generator.normalize_scores
    assert type(generator.search) is search.BeamSearch
    defaults = task.build_generator([model], argparse.Namespace())
    assert (defaults.beam_size, defaults.max_len_b, defaults.min_len, defaults.normalize_scores) == (5, 200, 1, True)
    sampler = task.build_generator([model], argparse.Namespace(sampling=True, sampling_topk=4, beam=2))
    assert isinstance(sampler.search, search.Sampling) and sampler.search.sampling_topk == 4
    assert isinstance(
        task.build_generator([model], argparse.Namespace(match_source_len=True)).search,
        search.LengthConstrainedBeamSearch,
    )
    for flags, message in (
        (dict(sampling=True, match_source_len=True), "--sampling and --match-source-len cannot be combined"),
        (dict(sampling_topk=5), "--sampling-topk 5 requires --sampling"),
        (dict(sampling_topp=0.9), "--sampling-topp 0.9 requires --sampling"),
        (dict(diverse_beam_groups=2), "--diverse-beam-groups is not supported"),
        (dict(constraints="ordered"), "--constraints is not supported"),
        (
            dict(sampling=True, sampling_topk=V + 1),
            "--sampling-topk 13 is out of range: -1 .* 1 to the vocabulary size 12",
        ),
        (dict(sampling=True, sampling_topk=-5), "--sampling-topk -5 is out of range"),
        (
            dict(sampling=True, sampling_topp=-0.5),
            r"--sampling-topp -0.5 is out of range: -1 \(off: all tokens\) or a "
            r"probability mass in \(0, 1\]",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            task.build_generator([model], argparse.Namespace(**flags))
    scorer = task.build_generator([model], argparse.Namespace(score_reference=True))
    assert type(scorer).__name__ == "SequenceScorer"  # upstream's --score-reference choice
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn"):
        task.build_generator([model], argparse.Namespace(), prefix_allowed_tokens_fn=lambda *a: [])


def test_no_cuda_graphs_flag():
    args = options.parse_args_and_arch(options.get_generation_parser(), ["DATA", "--no-cuda-graphs"])
    assert args.no_cuda_graphs
    task, model = lm_task(), build()
    assert not task.build_generator([model], args).cuda_graphs
    assert task.build_generator([model], argparse.Namespace()).cuda_graphs
