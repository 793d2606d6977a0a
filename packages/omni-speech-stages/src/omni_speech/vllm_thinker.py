"""``speech.thinker`` on vLLM (``engine: vllm``): Qwen2.5-Omni's thinker run by vLLM's own
model (``vllm/model_executor/models/qwen2_5_omni_thinker.py``), its segments the
transformers path's: the same tokens, payloads and rows (``embed``, ``hidden``, ``tts``).

vLLM 0.32 hands out no per-token hidden states through its API: ``SamplingParams`` has no
such field, and its ``extract_hidden_states`` speculative method with the
``ExampleHiddenStatesConnector`` writes the inputs of chosen layers (EAGLE 3's auxiliary
states, before the final norm) of a request to a file once the request ends, nothing while
it streams, on models that declare EAGLE 3 support (its Qwen2.5-Omni thinker does not). The
engine runs in this process, so its model runner is tapped instead: the runner's
``_model_forward`` (the one model call of each engine step; also where CUDA graphs replay
the model, though only vLLM's CPU build was run here) is wrapped, and for the requests that
speak the rows are copied out of that step: the input embeddings it was given and the
hidden states it returned (the last layer's, after the final norm: what vLLM's logits are
computed from and what transformers' ``hidden_states[-1]`` is), split by the batch's layout
(the runner's order of requests, their query offsets and computed-token counts) and kept by
position. A chunked prompt, or a preempted request that is recomputed, fills the same
positions again. A speaking request skips reading vLLM's prefix cache (the rows of a cached
prefix would not be computed); every request's prompt as vLLM rendered it is checked
against the stage's.

The text to say (``input``: the speech endpoint) runs as one prefill of the prompt and
that text, whose rows are those the transformers path gets feeding it token by token.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import numpy as np
from omni_ar.errors import RequestError
from omni_ar.params import params_payload
from omni_core.plugin import StageEvent, StageInput

from omni_speech.audio import audio_bytes_of, decode_audio
from omni_speech.prompt import AUDIO_PARTS, AUDIO_RATE, ThinkerInput, parse, render

if TYPE_CHECKING:
    from omni_speech.checkpoint import Voice
    from omni_speech.prompt import PromptLimits


class ThinkerStage(Protocol):
    """What this module reads of its stage (:class:`omni_speech.thinker.Thinker`); a
    protocol, so that this module, which the stage imports, does not import it."""

    voices: dict[str, Voice]
    default_voice: str
    eos: set[int]
    ids: dict[str, int]
    marks: dict[str, str]
    limits: PromptLimits
    images: Any
    """Its image processor."""
    options: Any
    """Its ``ThinkerOptions``."""

    def tts_rows(self, voice: str) -> Any:
        """The thinker's embeddings of what the talker adds around the reply."""
        ...


# images and audio clips a prompt (the thinker reads no video), and the image processor's
# PIL backend, the stage's own (the torchvision one, vLLM's choice where torchvision is
# installed, resizes otherwise: 0.015 apart in pixel values, 1.7e-2 in the hidden rows);
# engine_args override
ENGINE_ARGS: dict[str, Any] = {
    "limit_mm_per_prompt": {"image": 8, "audio": 8, "video": 0},
    "mm_processor_kwargs": {"use_fast": False},
}


class Rows:
    """One request's prompt as vLLM rendered it and, if it speaks, its rows as the engine
    steps compute them, by position."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep  # the rows (a request that speaks), else only the prompt
        self.chunks: list[tuple[int, np.ndarray, np.ndarray]] = []  # (start, embed, hidden)
        self.prompt: list[int] | None = None  # the prompt as vLLM rendered it
        self.vllm_id: str | None = None  # vLLM's id of the request
        self.error: str | None = None

    def take(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(embed, hidden) of positions ``lo`` to ``hi``; forgets every row before ``hi``."""
        for k, (start, e, h) in enumerate(self.chunks):
            if start <= lo and hi <= start + len(e):  # one step computed them all
                if hi == start + len(e):
                    del self.chunks[k]
                return e[lo - start : hi - start], h[lo - start : hi - start]
        embed = hidden = None
        filled = np.zeros(hi - lo, bool)
        for start, e, h in self.chunks:
            a, b = max(lo, start), min(hi, start + len(e))
            if a >= b:
                continue
            if embed is None or hidden is None:
                embed = np.empty((hi - lo, e.shape[1]), np.float32)
                hidden = np.empty((hi - lo, h.shape[1]), np.float32)
            embed[a - lo : b - lo] = e[a - start : b - start]
            hidden[a - lo : b - lo] = h[a - start : b - start]
            filled[a - lo : b - lo] = True
        if embed is None or hidden is None or not filled.all():
            raise RuntimeError(
                f"vLLM thinker: no rows for positions {lo} to {hi} "
                f"({self.error or 'the engine step that computed them was not seen'})"
            )
        self.chunks = [c for c in self.chunks if c[0] + len(c[1]) > hi]
        return embed, hidden


class RowTap:
    """Copies the rows of watched requests out of each engine step of ``runner`` (a vLLM
    v1 ``GPUModelRunner``, the CPU one included) by wrapping its ``_model_forward``."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.watched: dict[str, Rows] = {}  # by our request id
        self.by_vllm_id: dict[str, Rows] = {}  # by vLLM's, once seen
        self.inner = runner._model_forward
        runner._model_forward = self._forward

    def watch(self, rid: str, keep: bool) -> Rows:
        rows = self.watched[rid] = Rows(keep)
        return rows

    def forget(self, rid: str) -> None:
        rows = self.watched.pop(rid, None)
        if rows is not None and rows.vllm_id is not None:
            self.by_vllm_id.pop(rows.vllm_id, None)

    def close(self) -> None:
        self.runner._model_forward = self.inner
        self.watched.clear()
        self.by_vllm_id.clear()

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        if self.watched:
            try:
                self._copy(kwargs, out)
            except Exception as e:  # the engine goes on; the requests watched fail
                for rows in self.watched.values():
                    rows.error = f"copying the step's rows failed: {e!r}"
        return out

    def _copy(self, kwargs: dict[str, Any], out: Any) -> None:
        import torch

        hidden = out[0] if isinstance(out, tuple) else out  # (hidden, aux): EAGLE 3
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"the model returned {type(hidden).__name__}, not hidden states")
        r = self.runner
        batch = r.input_batch
        starts = r.query_start_loc.np
        picks: list[tuple[Rows, int, int]] = []  # (rows, first position, tokens)
        index: list[np.ndarray] = []
        for i, vid in enumerate(batch.req_ids[: batch.num_reqs]):
            rows = self.by_vllm_id.get(vid)
            if rows is None:  # vLLM's id is ours, a dash and 8 random characters
                rows = self.watched.get(vid) or self.watched.get(vid.rsplit("-", 1)[0])
                if rows is None:
                    continue
                rows.vllm_id = vid
                rows.prompt = list(r.requests[vid].prompt_token_ids or [])
                self.by_vllm_id[vid] = rows
            if rows.keep:
                a, b = int(starts[i]), int(starts[i + 1])
                picks.append((rows, int(batch.num_computed_tokens_cpu[i]), b - a))
                index.append(np.arange(a, b))
        if not picks:
            return
        at = torch.from_numpy(np.concatenate(index)).to(hidden.device)
        embeds = kwargs.get("inputs_embeds")  # None: a model given ids (serving no media)
        embed = r.model.embed_input_ids(kwargs["input_ids"][at]) if embeds is None else embeds[at]
        e, h = _host(embed), _host(hidden[at])  # one copy each for the whole step
        k = 0
        for rows, first, count in picks:
            rows.chunks.append((first, e[k : k + count], h[k : k + count]))
            k += count


def _host(t: Any) -> np.ndarray:
    """``t`` (gathered: not the runner's buffers, which the next step overwrites) as
    float32 numpy."""
    import torch

    return t.detach().to(device="cpu", dtype=torch.float32).numpy()


class VllmThinker:
    """The thinker's model on vLLM, in the stage's ``model`` (where the stage reads
    ``generation_config`` and ``get_input_embeddings``); :meth:`generate` runs a request."""

    def __init__(
        self,
        path: str,
        device: str,
        dtype: str,
        threads: int | None,
        engine_args: dict[str, Any],
    ) -> None:
        from omni_ar.engines.vllm_engine import VllmEngine
        from transformers import GenerationConfig

        self.engine = VllmEngine(
            path,
            dtype=dtype,
            threads=threads,
            engine_args={**ENGINE_ARGS, **engine_args},
            device=device,
        )
        self.engine.load_model()
        llm = self.engine.llm
        try:
            self.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:  # none: the stage takes the text config's EOS
            self.generation_config = GenerationConfig()
        (runner,) = llm.collective_rpc(lambda worker: worker.model_runner)
        self.tap = RowTap(runner)
        (self.embed,) = llm.apply_model(lambda m: m.get_language_model().embed_input_ids)

    def get_input_embeddings(self) -> Any:
        """vLLM's embedding of token ids (a tensor of them), as transformers' table."""
        return self.embed

    def close(self) -> None:
        self.tap.close()

    # -- a request ------------------------------------------------------------------------
    def generate(
        self, stage: ThinkerStage, inp: StageInput, ti: ThinkerInput
    ) -> Iterator[StageEvent | None]:
        """The request's segments, as ``Thinker.generate`` makes them on transformers."""
        speak = ti.speech.speak
        forced = ti.forced
        limit = len(forced) if forced is not None else ti.params.max_tokens
        try:
            prompt, grids = self._prompt(stage, inp, ti)
            sp = self._params(stage, ti, 1 if forced is not None else limit, speak)
            steps = self.engine.open(prompt, sp)
        except RequestError as e:  # vLLM refused it (a prompt past max_model_len)
            yield inp.fail(e)
            return
        except RuntimeError as e:
            yield inp.fail(f"vLLM thinker: {e}")
            return
        rid = steps.rid
        rows = self.tap.watch(rid, keep=speak)
        try:
            yield None  # the requests that came with this one enter the engine too
            payload: dict[str, Any] = {
                **params_payload(ti.params),
                "prompt_tokens": len(ti.ids),
                "speech": msgspec.to_builtins(ti.speech),
                "talker": {
                    "prompt_ids": ti.ids,
                    "image_grid_thw": grids or None,
                    "audio_lengths": [int(f.shape[1]) for f in ti.audio_features] or None,
                    "text_bos": stage.voices[ti.speech.voice].bos_token,
                },
            }
            tokens = self._tokens(steps, forced)
            n, p = 0, len(ti.ids)
            for token, end in tokens:
                if token is None:
                    yield None
                    continue
                if n == 0 and rows.prompt != [*ti.ids, *(forced or [])[:-1]]:
                    raise RuntimeError(
                        f"vLLM rendered the prompt as {len(rows.prompt or [])} tokens, not "
                        f"as the stage's {p} (its media placeholders expanded otherwise)"
                    )
                arrays = self._arrays(stage, ti, rows, n, p) if speak else None
                n += 1
                eos = token in stage.eos and not ti.params.ignore_eos
                done = eos or n >= limit or end
                if done:
                    payload["finish_reason"] = "stop" if token in stage.eos else "length"
                yield inp.segment([token], payload=payload, arrays=arrays, is_last=done)
                if done or inp.cancelled:
                    return
                payload = {}
        except RuntimeError as e:  # EngineRequestError too: vLLM ended it, or no rows
            yield inp.fail(f"vLLM thinker: {e}")
        finally:
            steps.close()
            self.tap.forget(rid)

    def _tokens(self, steps: Any, forced: list[int] | None) -> Iterator[tuple[int | None, bool]]:
        """(token, whether vLLM ended the request there); ``(None, False)`` while it waits.
        A given reply's tokens follow its one prefill step."""
        if forced is not None:
            for s in steps:
                if s is None:
                    yield None, False
                    continue
                for k, t in enumerate(forced):
                    yield t, k == len(forced) - 1
                return
            return
        for s in steps:
            if s is None:
                yield None, False
                continue
            yield s[0], steps.ended

    def _arrays(
        self, stage: ThinkerStage, ti: ThinkerInput, rows: Rows, n: int, p: int
    ) -> dict[str, Any]:
        """The n-th segment's rows: the prompt's (media embeddings zeroed) and the voice's
        ``tts`` rows first, then those of the token fed to make it."""
        if n == 0:
            embed, hidden = rows.take(0, p)
            media = np.isin(np.asarray(ti.ids), list(stage.ids.values()))
            embed[media] = 0
            tts = stage.tts_rows(ti.speech.voice).detach().float().cpu().numpy()
            return {"embed": embed, "hidden": hidden, "tts": tts}
        embed, hidden = rows.take(p + n - 1, p + n)
        return {"embed": embed, "hidden": hidden}

    def _prompt(
        self, stage: ThinkerStage, inp: StageInput, ti: ThinkerInput
    ) -> tuple[dict[str, Any], list[list[int]]]:
        """vLLM's input (each media span collapsed to its one placeholder, which vLLM's
        processor expands again; images as decoded, audio clips as waveforms) and the
        images' patch grids."""
        ids = list(ti.ids) + list((ti.forced or [])[:-1])
        marks = {stage.ids["audio"], stage.ids["image"]}
        collapsed = [t for k, t in enumerate(ids) if t not in marks or k == 0 or ids[k - 1] != t]
        prompt: dict[str, Any] = {"prompt_token_ids": collapsed}
        data: dict[str, Any] = {}
        grids: list[list[int]] = []
        if ti.images:
            data["image"] = list(ti.images)
            for px in ti.images:
                out = stage.images(images=[px], return_tensors="np")
                grids.append([int(v) for v in out["image_grid_thw"][0]])
        if ti.audio_features:
            waves = _waves(stage, inp.request)
            if len(waves) != len(ti.audio_features):
                raise RuntimeError(f"{len(waves)} audio clips, {len(ti.audio_features)} read")
            data["audio"] = [(w, AUDIO_RATE) for w in waves]
        if data:
            prompt["multi_modal_data"] = data
        return prompt, grids

    def _params(self, stage: ThinkerStage, ti: ThinkerInput, max_tokens: int, speak: bool) -> Any:
        """vLLM's sampling params: the stage's EOS set, not the tokenizer's EOS."""
        from vllm import SamplingParams as VllmParams
        from vllm.sampling_params import RequestOutputKind

        p = ti.params
        return VllmParams(
            max_tokens=max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed if p.temperature > 0 else None,
            ignore_eos=True,  # the tokenizer's; the stage's own EOS below
            stop_token_ids=[] if p.ignore_eos else sorted(stage.eos),
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            skip_reading_prefix_cache=speak,
        )


def _waves(stage: ThinkerStage, request: dict[str, Any]) -> list[np.ndarray]:
    """The request's audio clips as 16 kHz waveforms, decoded again as ``Thinker.read``
    decoded them: its input keeps only their features, and vLLM's processor takes
    waveforms (features given as ``input_audio_features`` beside a raw image fail in
    vLLM 0.32's processor, which counts them in the text it hands transformers')."""
    messages, _, _, said = parse(
        request, voices=list(stage.voices), default_voice=stage.default_voice, limits=stage.limits
    )
    if said is not None:  # the text to say replaces the messages: no media
        return []
    _, media = render(messages, stage.marks, stage.options.system_prompt)
    waves = []
    for where, part in media:
        if part["type"] in AUDIO_PARTS:
            src = audio_bytes_of(part, where, max_bytes=stage.limits.audio.max_bytes)
            budget = stage.limits.audio
            waves.append(
                decode_audio(
                    src.data, where=src.where, budget=budget, fmt=src.format, target_rate=AUDIO_RATE
                )
            )
    return waves
