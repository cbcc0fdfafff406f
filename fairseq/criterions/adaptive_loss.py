"""--criterion adaptive_loss: the loss of an adaptive softmax (Grave et al., https://arxiv.org/abs/1609.04309),
summed in nats and logged as --criterion cross_entropy logs (loss in base 2, ppl), as upstream does.

The head's cross-entropy covers every token (a word of a later band counts as its cluster), and each tail's
covers the tokens of its band, so the sum is -log p(target) under the full adaptive softmax: the value
--criterion cross_entropy or fairseq-eval-lm computes from the model's log-probabilities. Upstream also
ignores, inside each tail, the word whose offset in its band equals the padding index (its `ignore_index`
is applied to the tails' relative targets, so word `cutoff[i] + 1` never counts); here only padding is
left out.
"""

from dataclasses import dataclass

import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion
from fairseq.criterions.fairseq_criterion import FairseqCriterion
from fairseq.dataclass.configs import II


@dataclass
class AdaptiveLossConfig:
    sentence_avg: bool = II("optimization.sentence_avg", False)


def adaptive_softmax_of(model):
    """The adaptive softmax of `model`, or a ValueError saying how to get one."""
    adaptive_softmax = getattr(getattr(model, "decoder", None), "adaptive_softmax", None)
    if adaptive_softmax is None:
        raise ValueError(
            "--criterion adaptive_loss needs a model with an adaptive softmax: pass "
            "--adaptive-softmax-cutoff (e.g. 20000,60000) or --arch transformer_lm_wiki103, or use "
            "--criterion cross_entropy"
        )
    return adaptive_softmax


@register_criterion("adaptive_loss", dataclass=AdaptiveLossConfig)
class AdaptiveLoss(FairseqCriterion):
    def __init__(self, task, sentence_avg: bool):
        super().__init__(task)
        self.sentence_avg = bool(sentence_avg)

    def forward(self, model, sample, reduce: bool = True):
        """(loss, sample_size, logging_output): loss is the sum over target tokens in nats (fp32; per token,
        flattened [B*T], without `reduce`). The bands' rows are found on the device (one host
        synchronization per tail, as upstream); no logging value is read back."""
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        adaptive_softmax = adaptive_softmax_of(inner)
        # The features come from the model's own forward (where FSDP and DDP hooks run); the adaptive softmax
        # then scores each target's band only.
        features = model(**sample["net_input"], features_only=True)[0]  # (features, extra)
        target = inner.get_targets(sample, features)
        scores, targets = adaptive_softmax(features, target)
        flat_target = target.reshape(-1)
        head_loss = F.cross_entropy(scores[0].float(), targets[0], ignore_index=self.padding_idx, reduction="none")
        if reduce:
            loss = head_loss.sum()
            for band_scores, band_target in zip(scores[1:], targets[1:]):
                loss = loss + F.cross_entropy(band_scores.float(), band_target, reduction="sum")
        else:
            loss = head_loss
            _, rows = adaptive_softmax.adapt_target(flat_target)
            for band_scores, band_target, band_rows in zip(scores[1:], targets[1:], rows):
                band_loss = F.cross_entropy(band_scores.float(), band_target, reduction="none")
                loss = loss.index_add(0, band_rows, band_loss)
        nsentences = target.size(0)
        ntokens = sample["ntokens"]
        sample_size = nsentences if self.sentence_avg else ntokens
        logging_output = {
            "loss": loss.detach() if reduce else loss.detach().sum(),
            "ntokens": ntokens,
            "nsentences": nsentences,
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs):
        """Upstream's adaptive_loss logs what cross_entropy logs: loss (base 2, per sample_size unit),
        nll_loss when that unit is not the token, ppl."""
        return CrossEntropyCriterion.reduce_metrics(logging_outputs)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
