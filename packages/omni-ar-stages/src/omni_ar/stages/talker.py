"""``ar.talker``: a second AR stage fed by the first one's tokens in windows."""

from __future__ import annotations

from collections.abc import Iterator

from omni_core.plugin import StageEvent, StageInput

from omni_ar.params import SamplingParams, carried_params
from omni_ar.stages.base import ModelStage


class Talker(ModelStage):
    """A second AR stage fed by the first one's tokens in windows (the thinker -> talker
    shape of omni models): for each window it runs the model over the window's tokens
    (its left-context overlap included) and emits the next token it predicts."""

    def load(self) -> None:
        self.engine = self._engine()
        self.engine.load_model()
        self.params: dict[str, SamplingParams] = {}  # from the first window of each request

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            w = inp.window
            if inp.first:
                self.params[inp.request_id] = carried_params(w)
            if not w.new_tokens:  # an empty closing window
                yield inp.segment([], is_last=inp.last)
                continue
            params = self.params[inp.request_id]
            tok, lp, _, _ = self.engine.prefill(w.tokens, params)
            yield inp.segment(
                [tok],
                logprobs=[lp],
                payload={"window": w.index, "tokens_in": len(w.tokens), "context": w.overlap},
                is_last=inp.last,
            )

    def end_request(self, request_id: str) -> None:
        self.params.pop(request_id, None)
