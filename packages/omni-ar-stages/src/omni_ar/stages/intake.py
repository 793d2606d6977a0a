"""``ar.intake``: a request -> its prompt token ids."""

from __future__ import annotations

from collections.abc import Iterator

from omni_core import StageEvent, StageInput

from omni_ar.params import RequestError, params_payload, template_error
from omni_ar.stages.base import ModelStage


class Intake(ModelStage):
    """Request -> prompt token ids (one segment, with the request's params as parsed
    here), or an error naming the bad field."""

    def load(self) -> None:
        self.engine = self._engine(model=False)
        self.engine.load_tokenizer()

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            try:
                source, params = self.read(inp.request)
                ids = self.engine.encode(source)
            except RequestError as e:
                yield inp.fail(e)
                continue
            except Exception as e:  # e.g. a chat template that rejects the messages
                yield inp.fail(template_error(e))
                continue
            if len(ids) > self.options.max_prompt_tokens:
                yield inp.fail(
                    RequestError(
                        f"field 'prompt': {len(ids)} tokens, over max_prompt_tokens="
                        f"{self.options.max_prompt_tokens}"
                    )
                )
                continue
            yield inp.segment(ids, payload=params_payload(params), is_last=True)
