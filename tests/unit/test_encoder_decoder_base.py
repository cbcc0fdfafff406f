"""Upstream's encoder-decoder base classes (FairseqEncoder, EncoderOut, FairseqEncoderDecoderModel) and pair
batches (fairseq.data.language_pair_dataset: collate, LanguagePairDataset), as plug-ins use them."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fairseq.data import Dictionary, LanguagePairDataset
from fairseq.data.language_pair_dataset import collate
from fairseq.models import FairseqEncoder, FairseqEncoderDecoderModel, FairseqIncrementalDecoder
from fairseq.models.fairseq_encoder import EncoderOut
from fairseq.generation.sequence_scorer import SequenceScorer

PAD, EOS, BOS = 1, 2, 0
T = torch.tensor


def _dictionary(size=12):
    d = Dictionary()
    for i in range(size - d.nspecial):
        d.add_symbol(f"w{i}")
    return d


def _pairs():
    return [
        {"id": 0, "source": T([4, 5, 2]), "target": T([6, 2])},
        {"id": 1, "source": T([4, 5, 6, 7, 2]), "target": T([7, 8, 9, 2])},
        {"id": 2, "source": T([8, 2]), "target": T([5, 6, 7, 8, 9, 2])},
    ]


# ------------------------------------------------------------------------------------------------ collate


def test_collate_sorts_by_source_length_pads_and_shifts_the_target():
    batch = collate(_pairs(), PAD, EOS)
    assert batch["id"].tolist() == [1, 0, 2]  # descending source length
    assert batch["nsentences"] == 3 and batch["ntokens"] == 2 + 4 + 6  # target tokens
    net = batch["net_input"]
    assert net["src_lengths"].tolist() == [5, 3, 2]
    assert net["src_tokens"].tolist() == [[4, 5, 6, 7, 2], [1, 1, 4, 5, 2], [1, 1, 1, 8, 2]]  # left padding
    assert batch["target"].tolist() == [[7, 8, 9, 2, 1, 1], [6, 2, 1, 1, 1, 1], [5, 6, 7, 8, 9, 2]]
    assert net["prev_output_tokens"].tolist() == [[2, 7, 8, 9, 1, 1], [2, 6, 1, 1, 1, 1], [2, 5, 6, 7, 8, 9]]


def test_collate_left_padded_target_without_input_feeding_and_without_target():
    batch = collate(_pairs(), PAD, EOS, left_pad_source=False, left_pad_target=True, input_feeding=False)
    assert batch["net_input"]["src_tokens"].tolist() == [[4, 5, 6, 7, 2], [4, 5, 2, 1, 1], [8, 2, 1, 1, 1]]
    assert batch["target"].tolist() == [[1, 1, 7, 8, 9, 2], [1, 1, 1, 1, 6, 2], [5, 6, 7, 8, 9, 2]]
    assert "prev_output_tokens" not in batch["net_input"]
    left = collate(_pairs(), PAD, EOS, left_pad_target=True)["net_input"]["prev_output_tokens"]
    assert left.tolist() == [[1, 1, 2, 7, 8, 9], [1, 1, 1, 1, 2, 6], [2, 5, 6, 7, 8, 9]]

    sources_only = collate([{"id": s["id"], "source": s["source"]} for s in _pairs()], PAD, EOS)
    assert sources_only["target"] is None and sources_only["ntokens"] == 5 + 3 + 2
    assert "prev_output_tokens" not in sources_only["net_input"]
    assert collate([], PAD, EOS) == {}


def test_collate_widths_lengths_ties_and_given_decoder_inputs():
    batch = collate(_pairs(), PAD, EOS, pad_to_length={"source": 6, "target": 7}, pad_to_multiple=4)
    assert batch["net_input"]["src_tokens"].shape == (3, 8) and batch["target"].shape == (3, 8)
    assert batch["net_input"]["prev_output_tokens"].shape == (3, 8)
    # Lengths count non-padding tokens; equal lengths keep the input order.
    ties = collate(
        [{"id": 7, "source": T([4, 2])}, {"id": 3, "source": T([1, 5, 2])}, {"id": 5, "source": T([6, 2])}], PAD, EOS
    )
    assert ties["id"].tolist() == [7, 3, 5] and ties["net_input"]["src_lengths"].tolist() == [2, 2, 2]
    given = collate([{"id": 0, "source": T([4, 2]), "target": T([5, 2]), "prev_output_tokens": T([9, 5])}], PAD, EOS)
    assert given["net_input"]["prev_output_tokens"].tolist() == [[9, 5]]


# ------------------------------------------------------------------------------------ LanguagePairDataset


def _dataset(**kwargs):
    d = _dictionary()
    src = [T([4, 5, 2]), T([4, 5, 6, 7, 2]), T([8, 2]), T([6, 7, 2])]
    tgt = [T([6, 2]), T([7, 8, 9, 2]), T([5, 6, 7, 8, 9, 2]), T([9])]
    return LanguagePairDataset(src, [len(s) for s in src], d, tgt, [len(t) for t in tgt], d, **kwargs)


def test_dataset_sizes_order_filter_and_batches():
    ds = _dataset(shuffle=False)
    assert len(ds) == 4 and ds.sizes.tolist() == [[3, 2], [5, 4], [2, 6], [3, 1]]
    assert ds.num_tokens(2) == 6 and tuple(ds.size(2)) == (2, 6)
    assert ds.num_tokens_vec([0, 1, 2, 3]).tolist() == [3, 5, 6, 3]
    order = ds.ordered_indices()
    assert order.tolist() == [2, 3, 0, 1]  # by source length, ties by target length
    kept, dropped = ds.filter_indices_by_size(order, 4)
    assert kept.tolist() == [3, 0] and dropped == [2, 1]
    kept, dropped = ds.filter_indices_by_size(order, (3, None))
    assert kept.tolist() == [2, 3, 0] and dropped == [1]
    assert [b.tolist() for b in ds.batch_by_size(order, max_tokens=8)] == [[2], [3, 0], [1]]
    shuffled = _dataset(shuffle=True)
    torch.manual_seed(0)
    assert sorted(shuffled.ordered_indices().tolist()) == [0, 1, 2, 3]

    batch = ds.collater([ds[i] for i in (3, 0)])
    assert batch["id"].tolist() == [3, 0] and batch["target"].tolist() == [[9, 1], [6, 2]]
    assert batch["net_input"]["prev_output_tokens"].tolist() == [[2, 1], [2, 6]]  # eos first


def test_dataset_item_edits_and_language_ids():
    item = _dataset(append_eos_to_target=True)[3]
    assert item["source"].tolist() == [6, 7, 2] and item["target"].tolist() == [9, 2]
    assert _dataset(append_eos_to_target=True)[0]["target"].tolist() == [6, 2]  # eos already there
    item = _dataset(append_bos=True, remove_eos_from_source=True)[0]
    assert item == {"id": 0, "source": item["source"], "target": item["target"]}
    assert item["source"].tolist() == [BOS, 4, 5] and item["target"].tolist() == [BOS, 6, 2]

    ds = _dataset(src_lang_id=7, tgt_lang_id=8, eos=11)
    batch = ds.collater([ds[0], ds[1]])
    assert batch["net_input"]["src_lang_id"].tolist() == [[7], [7]] and batch["tgt_lang_id"].tolist() == [[8], [8]]
    assert batch["net_input"]["prev_output_tokens"][:, 0].tolist() == [11, 11]  # `eos` starts the decoder input
    assert ds.collater([]) == {}


def test_dataset_refuses_mismatched_inputs():
    d = _dictionary()
    with pytest.raises(ValueError, match="same number of items"):
        LanguagePairDataset([T([4, 2])], [2], d, [T([4, 2]), T([5, 2])], [2, 2], d)
    with pytest.raises(ValueError, match="share the pad index"):
        LanguagePairDataset([T([4, 2])], [2], d, [T([4, 2])], [2], Dictionary(pad="<s>"))


# ------------------------------------------------------------------------------- an encoder-decoder plug-in


class TinyEncoder(FairseqEncoder):
    def __init__(self, dictionary, dim=16):
        super().__init__(dictionary)
        self.embed = nn.Embedding(len(dictionary), dim, padding_idx=dictionary.pad())
        self.seen_updates = None

    def forward(self, src_tokens, src_lengths=None, **kwargs):
        x = self.embed(src_tokens)
        return EncoderOut(
            encoder_out=x.transpose(0, 1),
            encoder_padding_mask=src_tokens.eq(self.dictionary.pad()),
            encoder_embedding=x,
            encoder_states=None,
            src_tokens=src_tokens,
            src_lengths=src_lengths,
        )

    def reorder_encoder_out(self, encoder_out, new_order):
        return encoder_out._replace(
            encoder_out=encoder_out.encoder_out.index_select(1, new_order),
            encoder_padding_mask=encoder_out.encoder_padding_mask.index_select(0, new_order),
        )


class Counter(nn.Module):
    def set_num_updates(self, num_updates):
        self.num_updates = num_updates


class TinyDecoder(FairseqIncrementalDecoder):
    """Each target position adds the mean of the unpadded source states to its embedding."""

    def __init__(self, dictionary, dim=16):
        super().__init__(dictionary)
        self.embed = nn.Embedding(len(dictionary), dim, padding_idx=dictionary.pad())
        self.out = nn.Linear(dim, len(dictionary))

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        features, extra = self.extract_features(prev_output_tokens, encoder_out)
        return self.output_layer(features), extra

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        keep = (~encoder_out.encoder_padding_mask).t().unsqueeze(-1).float()  # T x B x 1
        context = (encoder_out.encoder_out * keep).sum(0) / keep.sum(0)  # B x C
        return self.embed(prev_output_tokens) + context.unsqueeze(1), {"attn": None}

    def output_layer(self, features, **kwargs):
        return self.out(features)

    def max_positions(self):
        return 64


class TinyModel(FairseqEncoderDecoderModel):
    pass


def _model():
    torch.manual_seed(0)
    d = _dictionary()
    return TinyModel(TinyEncoder(d), TinyDecoder(d)).eval(), d


def test_encoder_decoder_plugin_forward_features_and_limits():
    model, d = _model()
    batch = collate(_pairs(), d.pad(), d.eos())
    logits, extra = model(**batch["net_input"])
    assert logits.shape == (3, 6, len(d)) and extra == {"attn": None}
    features, _ = model.extract_features(**batch["net_input"])
    assert torch.equal(model.output_layer(features), logits)
    enc = model.encoder(batch["net_input"]["src_tokens"], batch["net_input"]["src_lengths"])
    assert torch.equal(model.forward_decoder(batch["net_input"]["prev_output_tokens"], encoder_out=enc)[0], logits)
    # Left padding of the source is masked: row 1 (item 0) equals item 0 encoded alone.
    alone, _ = model(**collate(_pairs()[:1], d.pad(), d.eos())["net_input"])
    torch.testing.assert_close(logits[1, :2], alone[0], rtol=0, atol=1e-6)
    assert model.max_positions() == (int(1e6), 64) and model.max_decoder_positions() == 64
    # The encoder gets net_input without the decoder's input.
    via_dict = model.encoder.forward_torchscript(batch["net_input"])
    assert torch.equal(via_dict.encoder_out, enc.encoder_out)
    reordered = model.encoder.reorder_encoder_out(enc, T([2, 0]))
    assert torch.equal(reordered.encoder_out, enc.encoder_out[:, [2, 0]])
    assert EncoderOut._fields == (
        "encoder_out",
        "encoder_padding_mask",
        "encoder_embedding",
        "encoder_states",
        "src_tokens",
        "src_lengths",
    )


def test_sequence_scorer_scores_the_target_under_the_plugin():
    model, d = _model()
    batch = collate(_pairs(), d.pad(), d.eos())
    hypos = SequenceScorer(d).generate([model], batch)
    log_probs = F.log_softmax(model(**batch["net_input"])[0].float(), dim=-1)
    row = 1  # item 0: target [6, 2]
    expected = log_probs[row, :2].gather(-1, T([[6], [2]])).squeeze(-1)
    assert hypos[row][0]["tokens"].tolist() == [6, 2]
    torch.testing.assert_close(hypos[row][0]["positional_scores"], expected, rtol=0, atol=1e-6)


def test_base_encoder_hooks_and_type_checks():
    d = _dictionary()
    encoder = FairseqEncoder(d)
    with pytest.raises(NotImplementedError, match="reorder_encoder_out"):
        encoder.reorder_encoder_out(None, T([0]))
    with pytest.raises(NotImplementedError, match="forward"):
        encoder(T([[4, 2]]))
    encoder.counter = Counter()
    encoder.set_num_updates(7)
    assert encoder.counter.num_updates == 7
    assert encoder.upgrade_state_dict_named({"a": 1}, "encoder") == {"a": 1}
    with pytest.raises(TypeError, match="FairseqEncoder and a FairseqDecoder, got Linear and TinyDecoder"):
        FairseqEncoderDecoderModel(nn.Linear(2, 2), TinyDecoder(d))
