"""``speech.talker``: Qwen2.5-Omni's talker, fed by the thinker's rows as they arrive.

The model's own ``generate`` runs the talker after the thinker ends. Its talker reads
one reply row a step, though (row ``j`` at code ``j``), so here it runs behind the thinker
instead: its prefill (the prompt's rows, the voice's start token, the first reply
token's row) as soon as the thinker fed that token, then a code for each reply row that
arrives; after the thinker's last row come the text end row and then pad rows until it
writes an end code. The codes are the same as ``generate``'s (same sampling, same order
of random draws from the request's seed).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import numpy as np
from omni_core.plugin import Stage, StageEvent, StageInput

from omni_speech.batch import Member, StepBatch
from omni_speech.checkpoint import load_part, resolve
from omni_speech.thinker import TORCH_PRELOAD


class TalkerSampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How codes are drawn: the defaults of Qwen2.5-Omni's ``generate``."""

    do_sample: bool = True
    top_k: int = 40
    top_p: float = 0.8
    temperature: float = 0.9
    repetition_penalty: float = 1.05


class TalkerOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options:`` of ``speech.talker``."""

    model: str  # the thinker's checkpoint
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    threads: int | None = None
    max_codes: int = 4096  # codes per reply at most (generate's talker_max_new_tokens)
    sampling: TalkerSampling = msgspec.field(default_factory=TalkerSampling)
    flush_codes: int = 16  # codes per segment once the thinker has ended


@dataclass
class _Reply:
    """One request's talker state."""

    speech: dict[str, Any]
    prompt_rows: Any  # (P, H) prompt embed + hidden
    tts: Any  # (3, H): voice start, text end, text pad
    talker: dict[str, Any]
    first_token: int | None = None
    rows: list[Any] = field(default_factory=list)  # reply rows not yet read
    started: bool = False
    cache: Any = None
    ids: Any = None  # every code id so far (the repetition penalty reads them)
    codes: int = 0
    finished: bool = False
    generator: Any = None
    sent_first: bool = False


class Talker(Stage):
    """The thinker's rows -> codec tokens."""

    Options = TalkerOptions
    preload = TORCH_PRELOAD

    def load(self) -> None:
        import torch
        from transformers import (
            LogitsProcessorList,
            RepetitionPenaltyLogitsProcessor,
            SuppressTokensLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        o: TalkerOptions = self.options
        if o.threads:
            torch.set_num_threads(o.threads)
        placement = self.ctx.place(o.dtype)
        self.device = placement.device
        self.model = load_part(resolve(o.model), "talker", placement.device, placement.dtype)
        m = self.model
        self.ends = {m.codec_pad_token, m.codec_eos_token}  # generate's talker_eos_token_id
        s = o.sampling
        procs: list[Any] = []
        if s.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
        procs.append(SuppressTokensLogitsProcessor([m.codec_bos_token], device=self.device))
        if s.do_sample:
            if s.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(s.temperature))
            if s.top_k:
                procs.append(TopKLogitsWarper(s.top_k))
            if s.top_p < 1.0:
                procs.append(TopPLogitsWarper(s.top_p))
        self.processors = LogitsProcessorList(procs)
        self.replies: dict[str, _Reply] = {}
        self.batch = StepBatch(self._forward, self._batch_pick, self.device)

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | None]:
        for inp in batch:
            yield from self._window(inp)

    def _window(self, inp: StageInput) -> Iterator[StageEvent | None]:
        r = self.replies.get(inp.request_id)
        for piece in inp.window.pieces:
            a, p = piece.arrays, piece.payload
            if r is None:
                if "speech" not in p:
                    yield inp.fail("upstream sent no speech settings with its first segment")
                    return
                r = self.replies[inp.request_id] = _Reply(
                    speech=p["speech"],
                    # none where the reply is text only (modalities ["text"])
                    prompt_rows=_sum(a, "embed", "hidden") if "embed" in a else None,
                    tts=a.get("tts"),
                    talker=p.get("talker", {}),
                )
                r.first_token = piece.tokens[0] if piece.tokens else None
                seed = r.speech.get("seed")
                r.generator = _generator(self.device, seed)
                continue
            if r.speech.get("speak") and "embed" in a:
                r.rows.append(_sum(a, "embed", "hidden"))
        if r is None:
            yield inp.segment([], is_last=inp.last)
            return
        if not r.speech.get("speak") or r.tts is None:
            if inp.last:
                yield self._out(inp, r, [], True)
            return
        yield from self._run(inp, r)

    def _run(self, inp: StageInput, r: _Reply) -> Iterator[StageEvent | None]:
        codes: list[int] = []
        if not r.started:
            if not r.rows:  # the first reply row has not come: wait (or it never will)
                if inp.last:
                    yield self._out(inp, r, [], True)
                return
            codes += self._prefill(r)
        while r.rows and not r.finished and not inp.cancelled:  # behind the thinker
            codes += self._step(r, r.rows.pop(0))
        if inp.last and not r.finished and not inp.cancelled:
            yield from self._tail(inp, r, codes)
        elif codes or inp.last:
            yield self._out(inp, r, codes, inp.last)

    def _tail(self, inp: StageInput, r: _Reply, codes: list[int]) -> Iterator[StageEvent]:
        """After the thinker's last row: its text end row, then pad rows, until an end
        code, stepped together with the other requests in their tails."""
        key = inp.request_id
        self.batch.add(key, r.cache, Member(r, (int(r.ids[0, -1]), r.tts[1:2])))
        try:
            while (got := self.batch.next(key)) is not None:
                codes += got
                if len(codes) >= self.options.flush_codes and not r.finished:
                    yield self._out(inp, r, codes, False)
                    codes = []
                if inp.cancelled:
                    break
        finally:
            self.batch.remove(key)
        yield self._out(inp, r, codes, True)

    def _forward(self, inputs: list[Any], positions: Any, mask: Any, cache: Any) -> Any:
        """One step of the requests in their tails (see :mod:`omni_speech.batch`)."""
        import torch

        m = self.model
        rows = np.stack([row for _, row in inputs])  # (B, 1, H)
        return m(
            input_ids=torch.tensor([[c] for c, _ in inputs], device=self.device),
            thinker_reply_part=torch.tensor(rows, dtype=m.dtype, device=self.device),
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )

    def _batch_pick(self, out: Any, row: int, r: _Reply) -> tuple[Any, Any, bool]:
        codes = self._pick(r, out.logits[row : row + 1])
        return codes, (int(r.ids[0, -1]), r.tts[2:3]), r.finished

    def _out(self, inp: StageInput, r: _Reply, codes: list[int], last: bool) -> StageEvent:
        payload: dict[str, Any] = {}
        if not r.sent_first:
            payload = {"speech": r.speech}
            r.sent_first = True
        return inp.segment(codes, payload=payload, is_last=last)

    def _prefill(self, r: _Reply) -> list[int]:
        """The prompt's rows, the voice's start row and the first reply row, run as
        ``generate`` runs them. With no padding (one request per forward), generate drops
        the all-ones attention mask (transformers 5), so the talker's forward takes its
        mask-less path: positions by index, no codec start markers added; so here."""
        import torch
        from transformers import DynamicCache

        m = self.model
        first_row = r.rows.pop(0)
        embeds = np.concatenate([r.prompt_rows, r.tts[0:1], first_row])
        n = len(r.talker["prompt_ids"])
        r.ids = torch.tensor(
            [[m.codec_mask_token] * n + [m.codec_pad_token, m.codec_bos_token]], device=self.device
        )
        r.cache = DynamicCache(config=m.config)
        with torch.inference_mode():
            out = m(
                inputs_embeds=torch.tensor(embeds[None], dtype=m.dtype, device=self.device),
                past_key_values=r.cache,
                use_cache=True,
            )
        r.started = True
        return self._pick(r, out.logits)

    def _step(self, r: _Reply, row: Any) -> list[int]:
        import torch

        m = self.model
        with torch.inference_mode():
            out = m(
                input_ids=r.ids[:, -1:],
                thinker_reply_part=torch.tensor(row[None], dtype=m.dtype, device=self.device),
                past_key_values=r.cache,
                use_cache=True,
            )
        return self._pick(r, out.logits)

    def _pick(self, r: _Reply, logits: Any) -> list[int]:
        """The next code, as ``generate`` draws it; [] once it is an end code."""
        import torch

        scores = logits[:, -1, :].to(dtype=torch.float32)
        scores = self.processors(r.ids, scores)
        if self.options.sampling.do_sample:
            probs = torch.softmax(scores, dim=-1)
            code = torch.multinomial(probs, 1, generator=r.generator)
        else:
            code = scores.argmax(-1, keepdim=True)
        r.ids = torch.cat([r.ids, code], dim=1)
        r.codes += 1
        c = int(code)
        if c in self.ends or r.codes >= self.options.max_codes:
            r.finished = True
            return [] if c in self.ends else [c]
        return [c]

    def end_request(self, request_id: str) -> None:
        self.replies.pop(request_id, None)
        self.batch.remove(request_id)


def _sum(arrays: dict[str, Any], a: str, b: str) -> Any:
    """The talker's input row(s): the thinker's embedding plus its last hidden state."""
    return np.asarray(arrays[a], dtype=np.float32) + np.asarray(arrays[b], dtype=np.float32)


def _generator(device: str, seed: int | None) -> Any:
    import torch

    return torch.Generator(device=device).manual_seed(
        seed if seed is not None else secrets.randbits(63)
    )
