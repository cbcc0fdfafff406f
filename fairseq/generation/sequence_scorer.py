"""Score given text with one full forward (upstream's SequenceScorer, what `--score-reference` and the hub's
`score()` use): per sentence one hypothesis dict whose `positional_scores` are the log-probabilities of its
target tokens, as `generate` returns for generated text.

    scorer = SequenceScorer(task.target_dictionary)
    hypos = task.inference_step(scorer, models, sample)   # a batch of task.build_dataset_for_inference

An ensemble's probabilities are averaged (then the log taken), as upstream does.
"""

from typing import Dict, List

import torch


class SequenceScorer:
    def __init__(
        self, tgt_dict, softmax_batch=None, compute_alignment: bool = False, eos=None, symbols_to_strip_from_output=None
    ):
        if compute_alignment:
            raise ValueError("compute_alignment: a language model has no source to align to")
        self.pad = tgt_dict.pad()
        self.eos = tgt_dict.eos() if eos is None else eos
        self.symbols_to_strip_from_output = set(symbols_to_strip_from_output or ()) | {self.eos}

    @torch.no_grad()
    def generate(self, models, sample: Dict, **kwargs) -> List[List[Dict[str, torch.Tensor]]]:
        """[[{"tokens": target without padding, "score": mean log p (NaN for an empty target, upstream's 0 / 0),
        "positional_scores": log p per token, "attention": None, "alignment": None}] per sentence]; other
        keywords (inference_step's prefix_tokens, bos_token) are ignored: the sample's source is the input, its
        target what is scored."""
        net_input = sample["net_input"]
        target = sample["target"]
        avg_probs = None
        for model in models:
            net_output = model(**net_input)
            log_probs = model.get_normalized_probs(net_output, log_probs=True, sample=sample)  # fp32
            target_log_probs = log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            if len(models) == 1:
                avg_probs = target_log_probs
            else:
                probs = target_log_probs.exp()
                avg_probs = probs if avg_probs is None else avg_probs + probs
        if len(models) > 1:
            avg_probs = avg_probs.div_(len(models)).log_()
        hypos = []
        for i in range(target.size(0)):
            keep = target[i].ne(self.pad)
            scores = avg_probs[i][keep]
            hypos.append(
                [
                    {
                        "tokens": target[i][keep],
                        "score": scores.sum() / scores.numel(),
                        "attention": None,
                        "alignment": None,
                        "positional_scores": scores,
                    }
                ]
            )
        return hypos
