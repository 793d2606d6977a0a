"""``ar.postprocess``: token segments -> text deltas, off the decode loop."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omni_core.plugin import StageEvent, StageInput

from omni_ar.detokenizer import IncrementalDetokenizer, detokenizer
from omni_ar.params import carried_params
from omni_ar.stages.base import ModelStage
from omni_ar.stages.logprobs import (
    PROMPT_LOGPROB_IDS,
    PROMPT_LOGPROBS,
    Alternatives,
    prompt_text_payload,
    token_texts,
    top_payload,
)


class Postprocess(ModelStage):
    """Token segments -> text deltas, with stop strings; streams to the caller."""

    def load(self) -> None:
        self.engine = self._engine(model=False)
        self.tokenizer = self.engine.load_tokenizer()
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self.prompt_tokens: dict[str, int] = {}  # until passed on with the next event
        self.prompt_lps: dict[str, dict[str, Any]] = {}  # prompt_logprobs, the same way
        self.finish: dict[str, str] = {}  # decode's finish reason, once it sent it
        self.want_logprobs: dict[str, bool] = {}
        self.tops: dict[str, Alternatives] = {}  # the requests that want top_logprobs

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            rid = inp.request_id
            d = self.detoks.get(rid)
            if d is None:
                params = carried_params(inp.window)  # with decode's first segment
                stop_ids = next((p["stop_ids"] for p in inp.window.payloads if "stop_ids" in p), [])
                d = self.detoks[rid] = detokenizer(self.tokenizer, params, stop_ids)
                self.want_logprobs[rid] = params.logprobs
                if params.top_logprobs:
                    self.tops[rid] = Alternatives()
            if d.stopped is not None:
                continue  # the text already ended at a stop string
            for p in inp.window.payloads:
                if "prompt_tokens" in p:
                    self.prompt_tokens[rid] = p["prompt_tokens"]
                if PROMPT_LOGPROB_IDS in p:
                    self.prompt_lps[rid] = prompt_text_payload(
                        self.tokenizer, p[PROMPT_LOGPROB_IDS]
                    )
                if "finish_reason" in p:  # decode's: "length" or "stop" (EOS)
                    self.finish[rid] = p["finish_reason"]
            alts = self.tops.get(rid)
            if alts is not None:
                alts.add(inp.window)
            new = inp.window.new_tokens
            text = d.add(new)
            if d.stopped is not None:
                payload = {"text": text, "finish_reason": "stop"}
            elif inp.last:
                reason = self.finish.get(rid, "stop")
                payload = {"text": text + d.flush(), "finish_reason": reason}
            elif new or text:
                payload = {"text": text}
            else:
                continue
            if rid in self.prompt_tokens:
                payload["prompt_tokens"] = self.prompt_tokens.pop(rid)
            if rid in self.prompt_lps:
                payload[PROMPT_LOGPROBS] = self.prompt_lps.pop(rid)
            lps = None
            if self.want_logprobs.get(
                rid
            ):  # the decode step's logprobs of the new tokens, with their text
                window_lps = inp.window.logprobs
                lps = window_lps[len(window_lps) - len(new) :] if new else []
                if len(lps) != len(new):  # an upstream that sent none: no logprobs
                    lps = None
                else:
                    payload["token_texts"] = token_texts(self.tokenizer, new)
                    tops = alts.take(inp.window.start, len(new)) if alts is not None else []
                    if alts is not None and len(tops) == len(new):
                        payload["top_logprobs"] = top_payload(self.tokenizer, tops)
            yield inp.segment(
                new, logprobs=lps, payload=payload, is_last="finish_reason" in payload
            )

    def end_request(self, request_id: str) -> None:
        self.detoks.pop(request_id, None)
        self.prompt_tokens.pop(request_id, None)
        self.prompt_lps.pop(request_id, None)
        self.finish.pop(request_id, None)
        self.want_logprobs.pop(request_id, None)
        self.tops.pop(request_id, None)
