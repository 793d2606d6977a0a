"""``speech.thinker``: Qwen2.5-Omni's thinker, one token a step, each with the rows the
talker reads.

Each segment carries a text token (for ``ar.postprocess``) and, when the request asks for
speech, the thinker's input embedding and last hidden state of the token it fed to make
it (``arrays["embed"]``, ``arrays["hidden"]``: one row each): the first segment carries
the prompt's rows (image and audio positions' embeddings zeroed, as the model's own
``generate`` hands them to its talker) and ``arrays["tts"]``, the embeddings of the
voice's start token and the talker's text end and pad tokens. The rows travel through
the data plane as arrays, never pickled.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np
from omni_ar.errors import RequestError
from omni_ar.multimodal.media import decode_image, source_bytes
from omni_ar.params import params_payload
from omni_core.plugin import Stage, StageEvent, StageInput

from omni_speech.audio import AudioBudget, audio_bytes_of, decode_audio
from omni_speech.batch import Member, StepBatch
from omni_speech.checkpoint import load_part, load_voices, resolve
from omni_speech.processors import image_processor_class
from omni_speech.prompt import (
    AUDIO_PARTS,
    AUDIO_RATE,
    QWEN_SYSTEM,
    PromptLimits,
    ThinkerInput,
    audio_tokens,
    parse,
    render,
)

TORCH_PRELOAD = ("torch", "transformers")
CHARS_PER_TOKEN = 16  # a prompt longer than this many characters a token is refused unread


class ThinkerOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options:`` of ``speech.thinker``."""

    model: str  # a Qwen2.5-Omni checkpoint directory, or tiny-qwen2.5-omni
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    threads: int | None = None  # torch threads in this worker
    max_prompt_tokens: int = 8192
    max_tokens_limit: int = 2048
    default_max_tokens: int = 256
    system_prompt: str | None = QWEN_SYSTEM  # a request's own system turn wins
    default_voice: str | None = None  # None: the checkpoint's first voice
    max_image_pixels: int = 1280 * 28 * 28  # per image, from its header
    max_media: int = 8  # images and audio clips in one request
    # per audio clip; the audio encoder reads 30 s at most (Whisper's window)
    audio: AudioBudget = msgspec.field(default_factory=lambda: AudioBudget(max_seconds=30.0))
    # vllm: vLLM's own model (omni_speech.vllm_thinker), the same segments and rows
    engine: Literal["transformers", "vllm"] = "transformers"
    engine_args: dict[str, Any] = msgspec.field(default_factory=dict)  # vLLM's LLM(...)


@dataclass
class _Reply:
    """One request's decode state in the batch."""

    ti: ThinkerInput
    gen: Any  # its sampler's generator
    limit: int  # tokens at most
    speak: bool  # the talker's rows go with each token
    n: int = 0  # tokens so far
    finish: str = "length"


class Thinker(Stage):
    """Qwen2.5-Omni's thinker: text, images and audio in; text tokens and the talker's
    rows out."""

    Options = ThinkerOptions
    preload = TORCH_PRELOAD

    def load(self) -> None:
        import torch
        from transformers import AutoConfig, AutoTokenizer, WhisperFeatureExtractor

        o: ThinkerOptions = self.options
        if o.threads:
            torch.set_num_threads(o.threads)
        placement = self.ctx.place(o.dtype)
        self.device = placement.device
        path = resolve(o.model)
        if o.engine == "vllm":
            from omni_speech.vllm_thinker import VllmThinker

            self.model: Any = VllmThinker(path, placement.device, o.dtype, o.threads, o.engine_args)
        else:
            self.model = load_part(path, "thinker", placement.device, placement.dtype)
        config = AutoConfig.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.features = WhisperFeatureExtractor.from_pretrained(path)
        self.images = image_processor_class().from_pretrained(path)
        self.voices = load_voices(path)
        self.default_voice = o.default_voice or next(iter(self.voices))
        if self.default_voice not in self.voices:
            raise ValueError(
                f"default_voice {self.default_voice!r}: not one of {list(self.voices)}"
            )
        tc, kc = config.thinker_config, config.talker_config
        self.ids = {
            "audio": tc.audio_token_index,
            "image": tc.image_token_index,
            "video": tc.video_token_index,
        }
        self.marks = {
            "audio": self.tokenizer.convert_ids_to_tokens(tc.audio_token_index),
            "image": self.tokenizer.convert_ids_to_tokens(tc.image_token_index),
            "audio_bos": self.tokenizer.convert_ids_to_tokens(tc.audio_start_token_id),
            "audio_eos": self.tokenizer.convert_ids_to_tokens(tc.audio_end_token_id),
            "vision_bos": self.tokenizer.convert_ids_to_tokens(tc.vision_start_token_id),
            "vision_eos": self.tokenizer.convert_ids_to_tokens(tc.vision_end_token_id),
        }
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = tc.text_config.eos_token_id
        self.eos = {eos} if isinstance(eos, int) else set(eos or ())
        self.text_end, self.text_pad = kc.tts_text_end_token_id, kc.tts_text_pad_token_id
        self.merge = tc.vision_config.spatial_merge_size
        self.batch = StepBatch(self._forward, self._pick, self.device)
        self.limits = PromptLimits(
            o.max_prompt_tokens,
            o.max_tokens_limit,
            o.default_max_tokens,
            o.max_image_pixels,
            o.audio,
        )

    # -- reading a request ------------------------------------------------------------

    def read(self, request: dict[str, Any]) -> ThinkerInput:
        """The request as the thinker runs it, or a RequestError naming the field."""
        messages, params, speech, said = parse(
            request,
            voices=list(self.voices),
            default_voice=self.default_voice,
            limits=self.limits,
        )
        if said is not None:  # say the input as it is: the user turn only asks for it
            messages = [*messages[:-1], {"role": "user", "content": said}]
        text, media = render(messages, self.marks, self.options.system_prompt)
        if len(text) > CHARS_PER_TOKEN * self.limits.max_prompt_tokens:  # before tokenizing
            raise RequestError(
                f"field 'messages': {len(text)} characters, more than max_prompt_tokens="
                f"{self.limits.max_prompt_tokens} tokens can hold"
            )
        if len(media) > self.options.max_media:  # before any is decoded
            raise RequestError(
                f"field {media[self.options.max_media][0]!r}: more than max_media="
                f"{self.options.max_media} images and audio clips in one request"
            )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        inp = ThinkerInput(ids=[], params=params, speech=speech)
        counts: list[int] = []
        for where, part in media:
            if part["type"] in AUDIO_PARTS:
                src = audio_bytes_of(part, where, max_bytes=self.limits.audio.max_bytes)
                wave = decode_audio(
                    src.data,
                    where=src.where,
                    budget=self.limits.audio,
                    fmt=src.format,
                    target_rate=AUDIO_RATE,
                )
                feats = self.features(
                    wave,
                    sampling_rate=AUDIO_RATE,
                    padding="max_length",
                    return_attention_mask=True,
                    return_tensors="np",
                )
                frames = int(feats["attention_mask"][0].sum())
                inp.audio_features.append(feats["input_features"][0][:, :frames])
                counts.append(audio_tokens(frames))
            else:
                data = source_bytes(part, where)
                px = decode_image(data, where, self.limits.max_image_pixels)
                inp.images.append(px)
                h, w = self._grid(px)
                counts.append(h * w // self.merge**2)
        inp.ids = self._expand(ids, counts)
        if len(inp.ids) > self.limits.max_prompt_tokens:
            raise RequestError(
                f"field 'messages': the prompt is {len(inp.ids)} tokens, over "
                f"max_prompt_tokens={self.limits.max_prompt_tokens}"
            )
        if said is not None:
            inp.forced = self.tokenizer(said, add_special_tokens=False)["input_ids"]
            inp.forced.append(min(self.eos))
        return inp

    def _grid(self, px: np.ndarray) -> tuple[int, int]:
        out = self.images(images=[px], return_tensors="np")
        _, h, w = (int(v) for v in out["image_grid_thw"][0])
        return h, w

    def _expand(self, ids: list[int], counts: list[int]) -> list[int]:
        """Each media placeholder repeated as often as its features fill it, in order."""
        marks = {self.ids["audio"], self.ids["image"]}
        out: list[int] = []
        it = iter(counts)
        for t in ids:
            out.extend([t] * next(it) if t in marks else [t])
        return out

    # -- running it -------------------------------------------------------------------

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | None]:
        for inp in batch:
            try:
                ti = self.read(inp.request)
            except RequestError as e:
                yield inp.fail(e)
                continue
            yield from self.generate(inp, ti)

    def forward_inputs(self, ti: ThinkerInput) -> dict[str, Any]:
        """The model's inputs for the prompt: ids, mask, media features (tensors)."""
        import torch

        kw: dict[str, Any] = {"input_ids": torch.tensor([ti.ids], device=self.device)}
        kw["attention_mask"] = torch.ones_like(kw["input_ids"])
        if ti.audio_features:
            frames = max(f.shape[1] for f in ti.audio_features)
            feats = np.zeros((len(ti.audio_features), ti.audio_features[0].shape[0], frames))
            mask = np.zeros((len(ti.audio_features), frames), dtype=np.int64)
            for k, f in enumerate(ti.audio_features):
                feats[k, :, : f.shape[1]] = f
                mask[k, : f.shape[1]] = 1
            kw["input_features"] = torch.tensor(feats, dtype=self.model.dtype, device=self.device)
            kw["feature_attention_mask"] = torch.tensor(mask, device=self.device)
        if ti.images:
            out = self.images(images=ti.images, return_tensors="pt")
            kw["pixel_values"] = out["pixel_values"].to(self.device, self.model.dtype)
            kw["image_grid_thw"] = out["image_grid_thw"].to(self.device)
        return kw

    def generate(self, inp: StageInput, ti: ThinkerInput) -> Iterator[StageEvent | None]:
        if self.options.engine == "vllm":
            yield from self.model.generate(self, inp, ti)
            return
        import torch
        from transformers import DynamicCache

        kw = self.forward_inputs(ti)
        ids = kw["input_ids"]
        lengths = kw["feature_attention_mask"].sum(-1) if "feature_attention_mask" in kw else None
        positions, delta = self.model.get_rope_index(
            ids, kw.get("image_grid_thw"), None, kw["attention_mask"], False, lengths, None
        )
        cache = DynamicCache(config=self.model.config)
        speak = ti.speech.speak
        seed = ti.params.seed if ti.params.seed is not None else secrets.randbits(63)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        with torch.inference_mode():
            out = self.model(
                **kw,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=speak,
            )
        arrays: dict[str, Any] | None = None
        if speak:
            embed = out.hidden_states[0][0].clone()
            media = torch.isin(ids[0], torch.tensor(list(self.ids.values()), device=self.device))
            embed[media] = 0
            arrays = {
                "embed": _rows(embed),
                "hidden": _rows(out.hidden_states[-1][0]),
                "tts": _rows(self.tts_rows(ti.speech.voice)),
            }
        payload: dict[str, Any] = {
            **params_payload(ti.params),
            "prompt_tokens": len(ti.ids),
            "speech": msgspec.to_builtins(ti.speech),
            "talker": {
                "prompt_ids": ti.ids,
                "image_grid_thw": kw["image_grid_thw"].tolist() if ti.images else None,
                "audio_lengths": lengths.tolist() if lengths is not None else None,
                "text_bos": self.voices[ti.speech.voice].bos_token,
            },
        }
        limit = len(ti.forced) if ti.forced is not None else ti.params.max_tokens
        token = self._next(out.logits[0, -1], ti, 0, gen)
        state = _Reply(ti, gen, limit, speak)
        done = self._done(state, token)
        if done:
            payload["finish_reason"] = state.finish
        key = inp.request_id
        if not done:  # in the batch before its first token goes out: the next step has it
            self.batch.add(key, cache, Member(state, token, int(delta.reshape(-1)[0])))
        try:
            yield inp.segment([token], payload=payload, arrays=arrays, is_last=done)
            if done or inp.cancelled:
                return
            while (step := self.batch.next(key)) is not None:
                token, arrays, done = step
                payload = {"finish_reason": state.finish} if done else {}
                yield inp.segment([token], payload=payload, arrays=arrays, is_last=done)
                if done or inp.cancelled:
                    return
        finally:
            self.batch.remove(key)

    def _forward(self, tokens: list[int], positions: Any, mask: Any, cache: Any) -> Any:
        """One decode step of the batch's members (see :mod:`omni_speech.batch`)."""
        import torch

        return self.model(
            input_ids=torch.tensor([[t] for t in tokens], device=self.device),
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )

    def _pick(self, out: Any, row: int, state: _Reply) -> tuple[Any, Any, bool]:
        """A member's next token, the talker's rows of the token it fed, and whether
        it ends there."""
        arrays = None
        if state.speak:
            arrays = {
                "embed": _rows(out.hidden_states[0][row]),
                "hidden": _rows(out.hidden_states[-1][row]),
            }
        token = self._next(out.logits[row, -1], state.ti, state.n, state.gen)
        done = self._done(state, token)
        return (token, arrays, done), token, done

    def _done(self, state: _Reply, token: int) -> bool:
        state.n += 1
        eos = token in self.eos and not state.ti.params.ignore_eos
        if eos or state.n >= state.limit:
            state.finish = "stop" if token in self.eos else "length"
            return True
        return False

    def end_request(self, request_id: str) -> None:
        self.batch.remove(request_id)

    def close(self) -> None:
        """Take out the vLLM engine's row tap (engine: vllm); the engine goes with it."""
        close = getattr(self.model, "close", None) if hasattr(self, "model") else None
        if close is not None:
            close()
        self.model = None

    def _next(self, logits: Any, ti: ThinkerInput, n: int, gen: Any) -> int:
        """The n-th reply token (from its ``logits``, one row): the given one
        (``input``), else greedy or sampled."""
        import torch

        if ti.forced is not None:
            return ti.forced[n]
        last = logits.float()
        p = ti.params
        if p.temperature == 0:
            return int(last.argmax())
        probs = torch.softmax(last / p.temperature, -1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=gen))

    def tts_rows(self, voice: str) -> Any:
        """The thinker's embeddings of the voice's start token and of the talker's text
        end and pad tokens: what the talker adds around the reply."""
        import torch

        table = self.model.get_input_embeddings()
        ids = [self.voices[voice].bos_token, self.text_end, self.text_pad]
        with torch.inference_mode():
            return table(torch.tensor(ids, device=self.device))


def _rows(t: Any) -> np.ndarray:
    """A (rows, hidden) tensor as float32 numpy, for the data plane."""
    return t.detach().float().cpu().numpy()
