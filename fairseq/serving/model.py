"""The served model: text <-> ids, and the calls the decode thread makes on it that are not the running batch
(scoring a text through the project's scorer, beam search through the generator, the top-N of each position).

Prompts are kept as their content ids (no </s>): the decoder starts from </s> (or <s> with --add-bos-token), as
the hub and fairseq-interactive start it. Everything here that runs the model is called from the decode thread
only (fairseq.serving.scheduler), which owns the model.
"""

from typing import Dict, List, Optional, Tuple

import torch

from fairseq.generation.decode_memory import check_decode_memory, decode_positions
from fairseq.hub.hub_utils import GeneratorHubInterface
from fairseq.hub.text import move_to
from fairseq.generation.search import Sampling


class ServedModel:
    def __init__(self, hub: GeneratorHubInterface, name: str):
        self.hub, self.name = hub, name
        self.dictionary = hub.tgt_dict
        self.eos, self.pad = self.dictionary.eos(), self.dictionary.pad()
        self.vocab = len(self.dictionary)
        # a prompt's ids plus the </s> generation starts from fit the positions (check_prompt_lengths' rule)
        self.max_positions = hub.max_positions or 1 << 30

    @property
    def device(self) -> torch.device:
        return self.hub.device

    # ---- text ------------------------------------------------------------------------------------------------
    def encode(self, text: str) -> List[int]:
        """The prompt's ids without the </s> that encode() ends them with."""
        ids = self.hub.encode(text).tolist()
        return ids[:-1] if ids and ids[-1] == self.eos else ids

    def decode(self, ids: List[int]) -> str:
        return self.hub.decode(torch.tensor(ids, dtype=torch.long)) if ids else ""

    def continuation(self, prompt: List[int], new: List[int]) -> str:
        """The text `new` adds after the prompt: decoded with the prompt (joining spaces, BPE merges across the
        boundary), less the decoded prompt (not the text sent, which may differ: unknown words); `new` decoded
        alone where that is no prefix."""
        if not new:
            return ""
        shown, full = self.decode(prompt), self.decode(prompt + new)
        return full[len(shown) :] if full.startswith(shown) else self.decode(new)

    def token_pieces(self, context: List[int], ids: List[int]) -> List[str]:
        """Each token's text after `context` and the tokens before it (OpenAI's `tokens`)."""
        pieces, shown = [], self.decode(context)
        for i in range(len(ids)):
            text = self.decode(context + ids[: i + 1])
            pieces.append(text[len(shown) :] if text.startswith(shown) else self.decode([ids[i]]))
            shown = text
        return pieces

    def alternatives(self, context: List[int], top: Dict[int, float]) -> Dict[str, float]:
        """OpenAI's top_logprobs entry: each alternative's text after `context` (its symbol, e.g. </s>, where it
        shows no text) -> its log p."""
        shown = self.decode(context)
        out = {}
        for token, logprob in top.items():
            text = self.decode(context + [token])
            piece = text[len(shown) :] if text.startswith(shown) else ""
            out[piece or self.dictionary[token]] = logprob
        return out

    # ---- model calls (decode thread) ------------------------------------------------------------------------
    def score(self, ids: List[int]) -> List[float]:
        """log p of each id given </s> and the ids before it: the hub's score() (the SequenceScorer)."""
        if not ids:
            return []
        tokens = torch.tensor(ids + [self.eos], dtype=torch.long)
        hypo = self.hub.generate([tokens], score_reference=True)[0][0]
        return hypo["positional_scores"].float().tolist()

    @torch.no_grad()
    def top_logprobs(self, ids: List[int], top_n: int) -> List[Dict[int, float]]:
        """For each id of `ids`, the `top_n` most likely tokens at its position and their log p (one forward over
        </s> + ids)."""
        if not ids or top_n <= 0:
            return [{} for _ in ids]
        model = self.hub.models[0]
        start = self.dictionary.bos() if self.hub.task.cfg.add_bos_token else self.eos
        src = torch.tensor([[start] + ids[:-1]], dtype=torch.long, device=self.device)
        lprobs = model.get_normalized_probs(model(src), log_probs=True)[0].float()
        values, indices = lprobs.topk(min(top_n, lprobs.size(-1)), dim=-1)
        return [dict(zip(i.tolist(), v.tolist())) for i, v in zip(indices.cpu(), values.cpu())]

    def precheck(self, name: str, args: tuple) -> Optional[str]:
        """The error line the call `name(*args)` would raise on this process before it runs the model, or None:
        the decode memory check of beam's batch (the hub's, on this GPU's free memory; nothing on the CPU).
        Tensor-parallel ranks compare theirs before any of them runs the call (fairseq.serving.tensor_parallel)."""
        if name != "beam":
            return None
        prompt, max_new, width, _ = args
        # the batch hub.generate checks in beam(): one prompt and its </s>, outputs of at most prompt + max_new
        positions = decode_positions(len(prompt) + 1, 0, len(prompt) + max_new, self.hub.max_positions)
        try:
            check_decode_memory(
                self.hub.models, 1, width, positions, self.device, fix="send a smaller best_of or max_tokens"
            )
        except ValueError as err:
            return str(err)
        return None

    def beam(self, prompt: List[int], max_new: int, width: int, nbest: int) -> List[Tuple[List[int], List[float], str]]:
        """The `nbest` best of a beam search of `width` (the generator's): (new ids, their log p, finish reason)."""
        tokens = torch.tensor(prompt + [self.eos], dtype=torch.long)
        hypos = self.hub.generate(
            [tokens], beam=width, nbest=nbest, max_len_a=0, max_len_b=len(prompt) + max_new, min_len=0
        )[0][:nbest]
        return [self.split_hypothesis(prompt, hypo, max_new) for hypo in hypos]

    def split_hypothesis(self, prompt: List[int], hypo, max_new: int) -> Tuple[List[int], List[float], str]:
        """(the ids generated after the prompt without the final </s>, their log p, 'stop' or 'length')."""
        tokens, scores = hypo["tokens"].tolist(), hypo["positional_scores"].float().tolist()
        new, new_scores = tokens[len(prompt) :], scores[len(prompt) :]
        if new and new[-1] == self.eos:
            ended = len(new) - 1 < max_new
            new, new_scores = new[:-1], new_scores[:-1]
        else:
            ended = False
        return new, new_scores, "stop" if ended else "length"

    def sample_alone(self, prompt: List[int], max_new: int, options: dict, seed: int, sample_id: int, on_tokens=None):
        """One choice decoded alone through the hub's generator (the serial backend): its hypothesis."""
        gen_options = dict(max_len_a=0, max_len_b=len(prompt) + max_new, min_len=0, **options)
        generator = self.hub.generator_for(1, **gen_options)
        if isinstance(generator.search, Sampling):
            generator.search.seed = seed
        task = self.hub.task
        tokens = torch.tensor(prompt + [self.eos], dtype=torch.long)
        dataset = task.build_dataset_for_inference([tokens], [tokens.numel()])
        sample = dataset.collater([dataset[0]])
        sample = dict(sample, id=torch.tensor([sample_id]))
        return task.inference_step(generator, self.hub.models, move_to(sample, self.device), on_tokens=on_tokens)[0][0]


def generation_options(temperature: float, top_p: float, top_k: int) -> Optional[dict]:
    """The generator's keyword options for OpenAI's sampling parameters (temperature 0: greedy)."""
    if temperature == 0:
        return {}
    options = {"sampling": True, "temperature": temperature}
    if top_p < 1:
        options["sampling_topp"] = top_p
    if top_k > 0:
        options["sampling_topk"] = top_k
    return options
