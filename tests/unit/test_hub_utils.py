"""fairseq.hub.hub_utils: TransformerLanguageModel.from_pretrained on a tiny model trained here by the real
fairseq-train on sentencepiece-encoded text (no network). encode/decode go through the checkpoint's
sentencepiece model; score() equals the log-softmax of one full forward; greedy generation equals the argmax of
full forwards; bad input is a clear error."""

import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from fairseq.hub.hub_utils import GeneratorHubInterface
from fairseq.models.transformer_lm import TransformerLanguageModel
from fairseq_cli import preprocess, train

from tests.conftest import write_corpus

PROMPTS = ["w1 w2 w3", "w5", "w0 w12 w1 w4 w3 w2 w1"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread


def greedy_by_full_forwards(model, prompt, max_len, eos, pad, min_len=1):
    """Upstream's greedy decoding without a cache: from </s> + `prompt` (ids without </s>), append the argmax
    of a full forward over everything so far (never <pad>, no </s> before `min_len` tokens) until </s> or
    `max_len` tokens, then </s>. Returns the hypothesis tokens (prompt included, ending with </s>)."""
    tokens = [eos] + list(prompt)
    with torch.no_grad():
        while len(tokens) - 1 < max_len:
            logits = model(torch.tensor([tokens]))[0][0, -1].float()
            logits[pad] = -math.inf
            if len(tokens) - 1 < min_len:
                logits[eos] = -math.inf
            tokens.append(int(logits.argmax()))
            if tokens[-1] == eos:
                return tokens[1:]
    return tokens[1:] + [eos]


def full_forward_log_probs(model, ids):
    """log p(ids[k] | </s>, ids[:k]) for each k, from one forward in fp32."""
    source = torch.cat([torch.tensor([2]), ids[:-1]]) if len(ids) else torch.tensor([2])
    with torch.no_grad():
        log_probs = F.log_softmax(model(source[None])[0][0].float(), dim=-1)
    return log_probs.gather(1, ids[:, None]).squeeze(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, train_args):
    """(checkpoint directory, data directory, sentencepiece model): text -> spm -> fairseq-preprocess --bpe
    sentencepiece -> fairseq-train --bpe sentencepiece (so the checkpoint's config names the spm model)."""
    spm = pytest.importorskip("sentencepiece")
    root = tmp_path_factory.mktemp("hub")
    write_corpus(root / "train.txt", 400, seed=1)
    write_corpus(root / "valid.txt", 40, seed=2)
    spm.SentencePieceTrainer.Train(
        input=str(root / "train.txt"), model_prefix=str(root / "spm"), vocab_size=40, model_type="bpe", minloglevel=2
    )
    bpe = ["--bpe", "sentencepiece", "--sentencepiece-model", str(root / "spm.model")]
    preprocess.cli_main(
        [
            "--only-source",
            "--trainpref",
            str(root / "train.txt"),
            "--validpref",
            str(root / "valid.txt"),
            "--destdir",
            str(root / "data"),
            "--workers",
            "1",
            *bpe,
        ]
    )
    train.cli_main(train_args(root / "data", root / "model", *bpe, max_update=8))
    return root / "model", root / "data", root / "spm.model"


@pytest.fixture(scope="module")
def hub(model_dir):
    save_dir, data, _ = model_dir
    return TransformerLanguageModel.from_pretrained(str(save_dir), "checkpoint_last.pt", data_name_or_path=str(data))


def test_from_pretrained_gives_the_interface_with_the_checkpoints_sentencepiece(hub, model_dir):
    import sentencepiece

    _, _, spm_path = model_dir
    assert isinstance(hub, GeneratorHubInterface) and hub.device == torch.device("cpu")
    assert not hub.models[0].training
    assert hub.cfg.bpe._name == "sentencepiece" and hub.cfg.bpe.sentencepiece_model == str(spm_path)
    text = "w1 w22 w3"
    ids = hub.encode(text)
    pieces = sentencepiece.SentencePieceProcessor(model_file=str(spm_path)).encode(text, out_type=str)
    assert ids.tolist() == [hub.src_dict.index(p) for p in pieces] + [hub.src_dict.eos()]
    assert hub.src_dict.unk() not in ids.tolist()
    assert hub.decode(ids) == text


def test_score_equals_log_softmax_of_a_full_forward(hub):
    model = hub.models[0]
    results = hub.score(PROMPTS)  # one batch, right-padded
    for text, hypo in zip(PROMPTS, results):
        ids = hub.encode(text)[:-1]  # as upstream: the final </s> is not scored
        assert hypo["tokens"].tolist() == ids.tolist()
        expected = full_forward_log_probs(model, ids)
        torch.testing.assert_close(hypo["positional_scores"], expected, rtol=0, atol=1e-5)
        assert float(hypo["score"]) == pytest.approx(float(expected.mean()), abs=1e-5)
    single = hub.score(PROMPTS[0])
    torch.testing.assert_close(single["positional_scores"], results[0]["positional_scores"], rtol=0, atol=1e-5)
    # lines joined by </s>
    joined = hub.score("w1 w2\nw3", replace_newline_with_eos=True)
    assert joined["tokens"].tolist() == torch.cat([hub.encode("w1 w2"), hub.encode("w3")])[:-1].tolist()


def test_greedy_generation_is_the_argmax_of_full_forwards(hub):
    model, d = hub.models[0], hub.tgt_dict
    encoded = [hub.encode(p) for p in PROMPTS]
    batched = hub.generate(encoded, beam=1, max_len_b=20)
    for text, ids, hypos in zip(PROMPTS, encoded, batched):
        expected = greedy_by_full_forwards(model, ids[:-1].tolist(), 20, d.eos(), d.pad())
        assert hypos[0]["tokens"].tolist() == expected
        # the prompt's continuation does not depend on what it was batched with
        alone = hub.generate(ids, beam=1, max_len_b=20)
        assert alone[0]["tokens"].tolist() == expected
        assert hub.sample(text, beam=1, max_len_b=20) == hub.decode(hypos[0]["tokens"])
        # the generator's per-token scores (KV cache) agree with scoring the same text in one forward
        scored = full_forward_log_probs(model, hypos[0]["tokens"])
        torch.testing.assert_close(hypos[0]["positional_scores"], scored, rtol=0, atol=1e-5)
    assert hub.sample(PROMPTS, beam=1, max_len_b=20) == [hub.decode(h[0]["tokens"]) for h in batched]


def test_sampling_follows_the_seed_and_beam_returns_beam_hypotheses(hub):
    def draw():
        torch.manual_seed(7)
        return hub.sample(PROMPTS, beam=1, sampling=True, sampling_topk=10, temperature=0.9, max_len_b=16)

    first = draw()
    assert first == draw()
    assert all(s.startswith(p) for s, p in zip(first, PROMPTS))
    hypos = hub.generate(hub.encode(PROMPTS[0]), beam=3, max_len_b=12)
    assert len(hypos) == 3
    scores = [float(h["score"]) for h in hypos]
    assert scores == sorted(scores, reverse=True)
    # sampling with a beam of 3: three samples (upstream's hub does not tie --nbest to it, nor does this one)
    assert len(hub.generate(hub.encode(PROMPTS[0]), beam=3, sampling=True, max_len_b=12)) == 3


def test_prompt_longer_than_the_models_positions(hub):
    long_prompt = hub.encode(" ".join(["w1"] * 40))  # 80 pieces, the model has 32 positions
    short = hub.encode(PROMPTS[0])
    with pytest.raises(
        ValueError,
        match=r"prompt 0 is 81 tokens long .* more than the model's 32 positions .*"
        r"skip_invalid_size_inputs=True",
    ):
        hub.generate([long_prompt, short], beam=1)
    kept = hub.generate([long_prompt, short], beam=1, max_len_b=10, skip_invalid_size_inputs=True)
    assert len(kept) == 1 and kept[0][0]["tokens"][: len(short) - 1].tolist() == short[:-1].tolist()


def test_bad_generation_options(hub):
    with pytest.raises(ValueError, match="samplin=True is no generation option"):
        hub.sample(PROMPTS[0], samplin=True)
    with pytest.raises(ValueError, match=r"sampling_topk=5 needs sampling=True .*pass sampling=True or drop it"):
        hub.sample(PROMPTS[0], sampling_topk=5)
    with pytest.raises(ValueError, match=r"sampling_topp=0.9 needs sampling=True"):
        hub.sample(PROMPTS[0], sampling_topp=0.9)
    with pytest.raises(ValueError, match="--print-alignment"):
        hub.sample(PROMPTS[0], print_alignment=True)
    # out-of-range sampling options, named as the keyword arguments given (upstream's -1 means off)
    with pytest.raises(
        ValueError,
        match=r"^sampling_topk=-5 is out of range: -1 \(off: all tokens\) or a number of "
        r"tokens, 1 to the vocabulary size \d+$",
    ):
        hub.sample(PROMPTS[0], sampling=True, sampling_topk=-5)
    with pytest.raises(
        ValueError,
        match=r"^sampling_topp=-0.5 is out of range: -1 \(off: all tokens\) or a "
        r"probability mass in \(0, 1\]$",
    ):
        hub.generate(hub.encode(PROMPTS[0]), beam=1, sampling=True, sampling_topp=-0.5)


def test_casting_and_moving_the_interface(model_dir):
    save_dir, data, _ = model_dir
    lm = TransformerLanguageModel.from_pretrained(str(save_dir), "checkpoint_last.pt", data_name_or_path=str(data))
    greedy = lm.generate(lm.encode(PROMPTS[0]), beam=1, max_len_b=10)[0]
    lm.to(torch.bfloat16)
    assert next(lm.models[0].parameters()).dtype == torch.bfloat16 and lm.device == torch.device("cpu")
    hypo = lm.generate(lm.encode(PROMPTS[0]), beam=1, max_len_b=10)[0]
    assert hypo["positional_scores"].dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: the prompt's scores stay within a few hundredths of fp32's
    n = len(lm.encode(PROMPTS[0])) - 1
    torch.testing.assert_close(hypo["positional_scores"][:n], greedy["positional_scores"][:n], rtol=0, atol=0.1)


def test_sampling_with_a_seed_does_not_depend_on_the_batches(hub):
    options = dict(beam=1, sampling=True, sampling_topp=0.9, max_len_b=16)
    batch_size = hub.cfg.dataset.batch_size
    try:
        together = hub.sample(PROMPTS * 2, seed=3, **options)
        hub.cfg.dataset.batch_size = 1  # one input per batch
        assert hub.sample(PROMPTS * 2, seed=3, **options) == together
    finally:
        hub.cfg.dataset.batch_size = batch_size
    assert together[:3] != together[3:]  # the same prompt at another index: another draw
    assert hub.sample(PROMPTS * 2, seed=4, **options) != together
    torch.manual_seed(1)  # without a seed: a new one per call, from torch's RNG
    calls = [hub.sample(PROMPTS, **options), hub.sample(PROMPTS, **options)]
    torch.manual_seed(1)
    assert [hub.sample(PROMPTS, **options), hub.sample(PROMPTS, **options)] == calls and calls[0] != calls[1]


def test_stream_yields_the_text_of_sample_in_pieces(hub):
    for prompt, options in ((PROMPTS[0], {}), (PROMPTS[1], dict(sampling=True, sampling_topk=5, seed=2))):
        pieces = list(hub.stream(prompt, max_len_b=28, min_len=24, **options))
        seed = options.pop("seed", None)
        assert "".join(pieces) == hub.sample(prompt, beam=1, max_len_b=28, min_len=24, seed=seed, **options)
        assert len(pieces) >= 2 and pieces[0].startswith(prompt)  # 24+ tokens: two chunks at least
    with pytest.raises(ValueError, match="no generation option"):
        list(hub.stream(PROMPTS[0], no_such_option=1))


def test_interactive_with_bpe_prints_what_the_hub_samples(hub, model_dir, monkeypatch, capsys):
    import io
    import sys

    from fairseq_cli import interactive

    save_dir, data, spm_path = model_dir
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(PROMPTS) + "\n"))
    capsys.readouterr()
    interactive.cli_main(
        [
            str(data),
            "--path",
            str(save_dir / "checkpoint_last.pt"),
            "--cpu",
            "--beam",
            "1",
            "--max-len-b",
            "20",
            "--bpe",
            "sentencepiece",
            "--sentencepiece-model",
            str(spm_path),
        ]
    )
    lines = [line.split("\t") for line in capsys.readouterr().out.splitlines() if line[:2] in ("S-", "H-", "D-")]
    assert [fields[0] for fields in lines] == [f"{kind}-{i}" for i in range(len(PROMPTS)) for kind in "SHD"]
    hypos = hub.generate([hub.encode(p) for p in PROMPTS], beam=1, max_len_b=20)
    for i, (prompt, (hypo,)) in enumerate(zip(PROMPTS, hypos)):
        source, hypothesis, decoded = lines[3 * i : 3 * i + 3]
        # as upstream: S- and H- show the dictionary's pieces, D- the text --bpe decodes them into
        assert source[1] == hub.string(hub.encode(prompt))
        assert hypothesis[2] == hub.string(hypo["tokens"]) and decoded[2] == hub.decode(hypo["tokens"])
        assert decoded[2].startswith(prompt)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_in_fp32_and_fp16(model_dir):
    save_dir, data, _ = model_dir
    lm = TransformerLanguageModel.from_pretrained(str(save_dir), "checkpoint_last.pt", data_name_or_path=str(data))
    on_cpu = lm.score(PROMPTS)
    greedy = lm.sample(PROMPTS, beam=1, max_len_b=16)
    lm.cuda()
    assert lm.device.type == "cuda"
    for got, want in zip(lm.score(PROMPTS), on_cpu):
        torch.testing.assert_close(got["positional_scores"].cpu(), want["positional_scores"], rtol=0, atol=1e-4)
    assert lm.sample(PROMPTS, beam=1, max_len_b=16) == greedy
    lm.half()
    for got, want in zip(lm.score(PROMPTS), on_cpu):
        assert got["positional_scores"].dtype == torch.float32
        torch.testing.assert_close(got["positional_scores"].cpu(), want["positional_scores"], rtol=0, atol=0.05)


def test_from_pretrained_bad_input_and_files_found_in_the_model_directory(model_dir, tmp_path):
    save_dir, data, spm_path = model_dir
    with pytest.raises(ValueError, match="'transformer_lm.gpt2.small' is not a local directory.*no downloads"):
        TransformerLanguageModel.from_pretrained("transformer_lm.gpt2.small")
    with pytest.raises(FileNotFoundError, match="no dict.txt"):  # data_name_or_path "." is the model directory
        TransformerLanguageModel.from_pretrained(str(save_dir), "checkpoint_last.pt")
    with pytest.raises(ValueError, match="--bpe gpt2 needs --gpt2-encoder-json"):
        TransformerLanguageModel.from_pretrained(
            str(save_dir), "checkpoint_last.pt", data_name_or_path=str(data), bpe="gpt2"
        )
    # upstream's layout: model.pt, dict.txt and sentencepiece.bpe.model in one directory
    packed = tmp_path / "packed"
    packed.mkdir()
    shutil.copy(save_dir / "checkpoint_last.pt", packed / "model.pt")
    shutil.copy(data / "dict.txt", packed / "dict.txt")
    shutil.copy(spm_path, packed / "sentencepiece.bpe.model")
    lm = TransformerLanguageModel.from_pretrained(str(packed))
    assert lm.cfg.bpe.sentencepiece_model == str(packed / "sentencepiece.bpe.model")
    assert lm.cfg.task.data == str(packed)
    assert lm.decode(lm.encode("w7 w1")) == "w7 w1"
