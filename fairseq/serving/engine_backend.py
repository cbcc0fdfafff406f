"""The scheduler's backend over the decode engine (fairseq.generation.engine): each completion choice is one row
of the engine's running batch; `step` is one chunk of decode steps (one host sync) for every live row."""

import logging
from typing import Dict, List

import torch

from fairseq.generation.engine import DecodeEngine, DecodeRequest
from fairseq.serving.model import ServedModel
from fairseq.serving.scheduler import Choice, Event, SerialBackend

logger = logging.getLogger("fairseq.serving.scheduler")
CHUNK = 16  # decode steps between two chunk boundaries (where rows join and leave)


class EngineBackend:
    def __init__(self, model: ServedModel, max_rows: int, cuda_graphs: bool = True):
        hub = model.hub
        bos = model.dictionary.bos() if hub.task.cfg.add_bos_token else None
        self.engine = DecodeEngine(
            hub.models[0],
            model.dictionary,
            max_rows=max_rows,
            max_positions=model.max_positions,
            bos=bos,
            cuda_graphs=cuda_graphs,
        )
        self.index: Dict[str, int] = {}  # choice id -> its index in its request

    @property
    def live(self) -> bool:
        return self.engine.has_work

    @property
    def kv_capacity_tokens(self) -> int:
        return self.engine.kv_capacity_tokens

    def add(self, choice: Choice) -> None:
        self.index[choice.id] = choice.index
        self.engine.add(
            DecodeRequest(
                id=choice.id,
                prompt=torch.tensor(choice.prompt, dtype=torch.long),
                max_new_tokens=choice.max_new,
                temperature=choice.temperature,
                top_k=max(choice.top_k, 0),
                top_p=choice.top_p,
                seed=choice.seed,
                sample_index=choice.sample_id,
                logprobs=True,
                top_logprobs=choice.top_n,
            )
        )

    def idle(self) -> None:
        pass

    def cancel(self, choice_id: str) -> None:
        self.engine.cancel(choice_id)
        self.index.pop(choice_id, None)

    def step(self) -> List[tuple]:
        events = []
        for event in self.engine.step(CHUNK):
            index = self.index.get(event.id)
            if index is None:
                continue
            top = [dict(pairs) for pairs in event.top_logprobs] if event.top_logprobs else []
            events.append(
                (
                    event.id,
                    Event(
                        index,
                        list(event.tokens),
                        list(event.logprobs or []),
                        top,
                        event.finish_reason if event.finished else None,
                    ),
                )
            )
            if event.finished:
                del self.index[event.id]
        return events


def make_backend(model: ServedModel, max_rows: int, cuda_graphs: bool = True, serial: bool = False):
    """The decode engine's running batch of `max_rows` rows for `model`; with `serial`, or for a model the engine
    cannot step (no static one-token step: fconv_lm), the serial stand-in."""
    if not serial:
        try:
            return EngineBackend(model, max_rows, cuda_graphs)
        except ValueError as err:
            if "decode engine needs" not in str(err):
                raise
            logger.warning(f"{err}: requests are decoded one at a time")
    return SerialBackend(model)
