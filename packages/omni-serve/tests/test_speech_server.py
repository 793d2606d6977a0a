"""Speech over HTTP: ``omni serve configs/omni_speech.yaml`` (the tiny random
Qwen2.5-Omni, built offline into the server's cache) driven by the real ``openai`` client:
chat completions with ``modalities: ["text", "audio"]`` (``message.audio``, streamed as
``delta.audio``), ``/v1/audio/speech`` (whole, chunked, SSE), voices the model lacks, the
input limit, text-only requests; and, in-process over a scripted pipeline, an answer cut
after its audio began. The tiny model's words mean nothing and its audio is silence at
16 bits: the tests check the shapes, that the audio decodes at the model's rate, and that
streamed and whole answers agree (in length: another seed says it at another length)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from .conftest import Server, start_server, stop_server

pytest.importorskip("omni_speech", reason="needs the speech family (omni-speech-stages)")
av = pytest.importorskip("av")

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "omni_speech.yaml"
MODEL = "omni_speech"
RATE = 24000  # token2wav's output rate
VOICES = "Chelsie, Ethan"
ASK = [{"role": "user", "content": "say something"}]
# greedy and seeded: the same request says the same words the same way
SAME = {"max_tokens": 6, "temperature": 0, "seed": 1}


@pytest.fixture(scope="module")
def speech_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(CONFIG, tmp_path_factory.mktemp("speech-server"))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(speech_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{speech_server.url}/v1", api_key="unused", max_retries=0)


def decode(data: bytes, fmt: str | None = None) -> np.ndarray:
    """The samples of an audio file (``fmt="pcm"``: headerless 16-bit PCM at the model's
    rate), read to its end with PyAV (a streamed FLAC's or WAV's header does not know its
    length), checked to be mono at the model's rate and not empty."""
    if fmt == "pcm":
        samples, rate = np.frombuffer(data, "<i2").astype(np.float32) / 32768, RATE
    else:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.audio[0]
            assert stream.codec_context.channels == 1
            rate = stream.codec_context.sample_rate
            parts = [frame.to_ndarray().reshape(-1) for frame in container.decode(stream)]
        samples = np.concatenate(parts)
        if samples.dtype.kind == "i":
            samples = samples.astype(np.float32) / 32768
    assert rate == RATE and len(samples) > 0, (rate, samples.shape)
    return samples


def spoken_chat(client: openai.OpenAI, fmt: str = "wav", **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": fmt},
        **SAME,
        **kw,
    )


def test_models_lists_the_speech_endpoint(speech_server):
    card = httpx.get(f"{speech_server.url}/v1/models").json()["data"][0]
    assert card["omni"]["endpoints"] == [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/audio/speech",
    ]


def test_chat_with_audio_answers_message_audio(client):
    """``message.audio``: a whole WAV (exact sizes) at 24 kHz, its transcript the text
    the same request writes when it asks for text only; ``content`` null, as OpenAI."""
    r = spoken_chat(client)
    message = r.choices[0].message
    audio = message.audio
    assert audio is not None and message.content is None
    assert audio.id.startswith("audio_") and isinstance(audio.expires_at, int)
    data = base64.b64decode(audio.data)
    samples = decode(data)
    assert data[:4] == b"RIFF" and int.from_bytes(data[40:44], "little") == 2 * len(samples)
    text = client.chat.completions.create(model=MODEL, messages=ASK, **SAME)
    assert text.choices[0].message.audio is None
    assert audio.transcript == text.choices[0].message.content and audio.transcript
    assert r.usage.completion_tokens == text.usage.completion_tokens > 0


def test_streamed_chat_with_audio_gives_delta_audio_chunks(client):
    """``delta.audio`` chunks: the first with the audio's id, ``transcript`` deltas,
    ``data`` chunks that concatenate to one file (the same samples as the whole
    answer's), the last with ``expires_at`` only; no ``content`` text."""
    answer = spoken_chat(client, "pcm16").choices[0].message.audio
    whole = decode(base64.b64decode(answer.data), "pcm")
    deltas = [c.choices[0].delta for c in spoken_chat(client, "pcm16", stream=True) if c.choices]
    audio = [d.audio for d in deltas if d.audio is not None]
    assert not any(d.content for d in deltas)
    assert audio[0].id.startswith("audio_") and not any(a.id for a in audio[1:])
    data = [a.data for a in audio if a.data]
    assert len(data) > 1  # streamed in windows, not at the end in one piece
    streamed = decode(b"".join(base64.b64decode(d) for d in data), "pcm")
    np.testing.assert_array_equal(streamed, whole)
    assert "".join(a.transcript or "" for a in audio) == answer.transcript
    last = audio[-1].model_dump(exclude_none=True)
    assert set(last) == {"expires_at"}, last


def test_streamed_wav_chunks_concatenate_to_a_wav(client):
    chunks = spoken_chat(client, "wav", stream=True)
    audio = [c.choices[0].delta.audio for c in chunks if c.choices]
    decode(b"".join(base64.b64decode(a.data) for a in audio if a is not None and a.data))


def test_text_only_requests_make_no_audio(client):
    """No modalities, or ``["text"]``: text only, streamed or not; legacy completions too."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, modalities=["text"], **SAME)
    assert r.choices[0].message.audio is None and r.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **SAME))
    assert not any(c.choices[0].delta.audio for c in chunks if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    done = client.completions.create(model=MODEL, prompt="say something", **SAME)
    assert done.choices[0].text


# seeded (omni's extra field): the same input, the same audio; this one is said in
# several windows of the talker's codes
SPEAK = {"model": MODEL, "input": "one two three four"}
SEEDED = {"extra_body": {"seed": 0}}


def test_speech_endpoint_answers_audio_bytes(client):
    """``client.audio.speech.create``: WAV, PCM, FLAC and MP3 (OpenAI's default) bytes
    with their Content-Type, each decoding at 24 kHz to the same samples (MP3: as many,
    give or take its frames' padding). The tiny model's audio is silence at 16 bits:
    lengths carry the check (another seed says it at another length)."""
    kw = {**SPEAK, "voice": "Chelsie", **SEEDED}
    wav = client.audio.speech.create(response_format="wav", speed=1.0, **kw)
    assert wav.response.headers["content-type"] == "audio/wav"
    samples = decode(wav.content)
    pcm = client.audio.speech.create(response_format="pcm", **kw)
    assert pcm.response.headers["content-type"] == "audio/pcm"
    np.testing.assert_array_equal(decode(pcm.content, "pcm"), samples)
    flac = client.audio.speech.create(response_format="flac", **kw)
    assert flac.response.headers["content-type"] == "audio/flac"
    np.testing.assert_array_equal(decode(flac.content), samples)
    mp3 = client.audio.speech.create(**kw)
    assert mp3.response.headers["content-type"] == "audio/mpeg"
    assert abs(len(decode(mp3.content)) - len(samples)) <= 2 * 1152
    other = client.audio.speech.create(
        response_format="wav", extra_body={"seed": 1}, **SPEAK, voice="Chelsie"
    )
    assert len(decode(other.content)) != len(samples)


def test_speech_endpoint_streams_chunks(client, speech_server):
    """``with_streaming_response``: the body comes chunked, in several pieces, and they
    make one file; ``stream_format: "sse"`` gives ``speech.audio.delta`` events (the
    same audio) and ``speech.audio.done`` with the usage."""
    kw = {**SPEAK, "voice": "Ethan", "response_format": "wav"}
    with client.audio.speech.with_streaming_response.create(**kw, **SEEDED) as r:
        assert r.headers["transfer-encoding"] == "chunked"
        pieces = [p for p in r.iter_bytes(chunk_size=None) if p]
    assert len(pieces) > 1
    samples = decode(b"".join(pieces))
    with httpx.stream(
        "POST",
        f"{speech_server.url}/v1/audio/speech",
        json={**kw, "stream_format": "sse", "seed": 0},
        timeout=60,
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line[6:7] == "{"]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 1 and events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["output_tokens"] > 0
    sse_samples = decode(b"".join(base64.b64decode(e["audio"]) for e in deltas))
    np.testing.assert_array_equal(sse_samples, samples)


def test_a_voice_the_model_lacks_is_a_400_listing_its_voices(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model=MODEL, voice="alloy", input="hi")
    err = e.value.body
    assert err["param"] == "voice" and VOICES in err["message"], err
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL,
                messages=ASK,
                modalities=["text", "audio"],
                audio={"voice": "alloy", "format": "wav"},
                stream=stream,
            )
        assert e.value.body["param"] == "audio.voice" and VOICES in e.value.body["message"]


def test_speech_input_limit_and_refused_fields(client):
    """``input``: OpenAI's 4096 characters are taken (the answer begins; the client then
    leaves), one more is a 400 before the pipeline; ``speed`` other than 1.0 and
    ``instructions`` are 400s naming them."""
    text = ("hello world " * 400)[:4096]
    with client.audio.speech.with_streaming_response.create(
        model=MODEL, voice="Chelsie", input=text, response_format="pcm"
    ) as r:
        assert r.status_code == 200 and next(r.iter_bytes(chunk_size=None))
    for body, param in [
        ({"input": text + "!"}, "input"),
        ({"input": "hi", "speed": 1.5}, "speed"),
        ({"input": "hi", "speed": 9.0}, "speed"),
        ({"input": "hi", "instructions": "whisper"}, "instructions"),
        ({"input": "hi", "response_format": "ogg"}, "response_format"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.speech.create(model=MODEL, voice="Chelsie", **body)
        assert e.value.body["param"] == param, e.value.body
    # the server goes on after the client that left
    assert (
        decode(
            client.audio.speech.create(
                model=MODEL, voice="Ethan", input="ok", response_format="wav"
            ).content
        )
        is not None
    )


def wav_clip(seconds: float = 0.5, rate: int = 16000) -> str:
    """A base64 WAV of a 440 Hz tone."""
    from omni_speech.audio import encode_whole

    t = np.arange(int(seconds * rate)) / rate
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return base64.b64encode(encode_whole(tone, "wav", rate)).decode()


def test_chat_takes_input_audio_parts(client):
    """OpenAI's ``input_audio`` parts reach the thinker (a bad clip is a 400 naming the
    part); only in user messages."""

    def ask(data: str, role: str = "user") -> list[dict[str, Any]]:
        part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
        return [{"role": role, "content": [{"type": "text", "text": "what is this?"}, part]}]

    with_clip = client.chat.completions.create(model=MODEL, messages=ask(wav_clip()), **SAME)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, **SAME)
    assert with_clip.usage.prompt_tokens > plain.usage.prompt_tokens  # the clip's tokens
    for messages, param in [
        (ask(base64.b64encode(b"not audio at all").decode()), "messages[0].content[1]"),
        (ask(wav_clip(), role="assistant"), "messages[0].content[1]"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages, **SAME)
        assert (e.value.body["param"] or "").startswith(param), e.value.body


# ------------------------------------------------------------------ in-process, scripted


class SpeechPipe:
    """What the app reads of a speech Pipeline; each request answers ``script``."""

    def __init__(self, script: list[Any]) -> None:
        kinds = [
            ("thinker", "speech.thinker", {"model": "tiny-qwen2.5-omni"}, None),
            ("postprocess", "ar.postprocess", {"model": "tiny-qwen2.5-omni"}, True),
            ("audio", "speech.audio_encode", {}, True),
        ]
        stages = [
            SimpleNamespace(name=n, kind=k, options=o, client_stream=c) for n, k, o, c in kinds
        ]
        edges = [
            SimpleNamespace(source="thinker", target="postprocess"),
            SimpleNamespace(source="thinker", target="audio"),
        ]
        self.config = SimpleNamespace(
            name="fake", stages=stages, edges=edges, request_timeout_s=None
        )
        self.script = script
        self.requests: list[dict[str, Any]] = []

    async def astream(
        self, request: dict[str, Any], request_id: str, timeout_s: float | None
    ) -> AsyncIterator[Any]:
        self.requests.append(request)
        for ev in self.script:
            yield ev

    def health(self) -> dict[str, dict[str, Any]]:
        return {s.name: {"state": "ready", "healthy": True} for s in self.config.stages}

    def metrics(self) -> dict[str, Any]:
        return {"stages": {}, "in_flight": 0, "counts": {}}


def segment(**kw: Any) -> Any:
    from omni_core.events import Segment

    arrays = kw.pop("arrays", None)
    ev = Segment(request_id="r", **kw)
    if arrays is not None:
        ev.arrays = arrays
    return ev


def app_of(script: list[Any]) -> tuple[Any, SpeechPipe]:
    from fastapi.testclient import TestClient
    from omni_serve import ServeSettings, create_app

    pipe = SpeechPipe(script)
    return TestClient(create_app(pipe, ServeSettings(model_name=MODEL))), pipe  # type: ignore[arg-type]


AUDIO = {"media_type": "audio/wav", "format": "wav", "sample_rate": RATE}


def test_a_failure_after_the_audio_began_cuts_the_answer():
    """The status is sent with the first bytes; a failure after them must not end the
    body as if the file were whole: the server cuts the connection."""
    from omni_core.events import Error
    from omni_serve.routes.speech import AudioCut

    script = [
        segment(stage="postprocess", payload={"text": "hi"}),
        segment(stage="audio", payload=AUDIO, arrays={"audio": b"RIFF...."}),
        Error(request_id="r", stage="token2wav", message="boom", code="stage_error"),
    ]
    client, pipe = app_of(script)
    with pytest.raises(AudioCut):
        client.post("/v1/audio/speech", json={"input": "hi", "voice": "Chelsie"})
    assert pipe.requests[0] == {
        "input": "hi",
        "voice": "Chelsie",
        "audio": {"format": "mp3"},
        "modalities": ["text", "audio"],
    }


def test_a_pipeline_that_says_nothing_is_a_500_not_an_empty_file():
    client, _ = app_of([segment(stage="postprocess", payload={"text": "hi"}, is_last=True)])
    r = client.post("/v1/audio/speech", json={"input": "hi", "voice": "Chelsie"})
    assert r.status_code == 500 and "made no audio" in r.json()["error"]["message"]


def test_chat_fields_reach_the_thinker_as_it_reads_them():
    """pcm16 is the stages' pcm; a text-only chat says ``modalities: ["text"]`` (the
    thinker speaks by default); ``audio`` without the audio modality, tools with audio
    and an earlier answer's audio id are 400s naming the field."""
    client, pipe = app_of([segment(stage="postprocess", payload={"text": "hi"}, is_last=True)])
    chat = {"messages": ASK}
    r = client.post(
        "/v1/chat/completions",
        json={
            **chat,
            "modalities": ["text", "audio"],
            "audio": {"voice": "Ethan", "format": "pcm16"},
        },
    )
    assert r.status_code == 200, r.text
    assert pipe.requests[-1]["audio"] == {"voice": "Ethan", "format": "pcm"}
    assert r.json()["choices"][0]["message"]["audio"]["transcript"] == "hi"
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert pipe.requests[-1]["modalities"] == ["text"] and "audio" not in pipe.requests[-1]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    earlier = {"role": "assistant", "audio": {"id": "audio_1"}}
    for body, param in [
        ({**chat, "audio": {"voice": "Ethan"}}, "audio"),
        ({**chat, "modalities": ["text", "audio"], "tools": [tool]}, "modalities"),
        ({**chat, "modalities": []}, "modalities"),
        (
            {**chat, "audio": {"voice": "Ethan", "format": "ogg"}, "modalities": ["audio"]},
            "audio.format",
        ),
        ({"messages": [*ASK, earlier, *ASK]}, "messages[1].audio"),
    ]:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
