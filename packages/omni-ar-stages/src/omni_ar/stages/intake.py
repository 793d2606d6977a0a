"""``ar.intake``: a request -> its prompt token ids."""

from __future__ import annotations

from collections.abc import Iterator

from omni_core.plugin import StageEvent, StageInput

from omni_ar.params import RequestError, params_payload, template_error
from omni_ar.stages.base import ModelStage


class Intake(ModelStage):
    """Request -> prompt token ids (one segment, with the request's params as parsed
    here), or an error naming the bad field. A prompt given as token ids (vLLM's
    ``prompt: [int, ...]``) is fed as it is, each id checked against the tokenizer's
    vocabulary."""

    token_prompts = True

    def load(self) -> None:
        self.engine = self._engine(model=False)
        self.engine.load_tokenizer()

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            try:
                source, params = self.read(inp.request)
                given = isinstance(inp.request.get("prompt"), list)  # token ids
                ids = self._ids(source) if given else self.engine.encode(source)
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

    def _ids(self, prompt: list[int]) -> list[int]:
        """A prompt given as token ids, each in the tokenizer's vocabulary, or a
        RequestError naming the first that is not."""
        vocab = len(self.engine.tokenizer)
        for i, t in enumerate(prompt):
            if t >= vocab:
                raise RequestError(
                    f"field 'prompt[{i}]': token id {t} is not in the vocabulary (0..{vocab - 1})"
                )
        return list(prompt)
