"""The embedded voice over HTTP: ``omni serve configs/speech_voice.yaml`` driven by the
real ``openai`` client, its audio read back by the voice's oracle (omni_speech.oracle):
``/v1/audio/speech`` says its ``input`` exactly, streamed or whole, in WAV and FLAC; a
spoken chat answer's audio says its transcript."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from .conftest import Server, start_server, stop_server

pytest.importorskip("omni_speech", reason="needs the speech family (omni-speech-stages)")
av = pytest.importorskip("av")

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "speech_voice.yaml"
SAY = "Call me at 10:30, ok?"


@pytest.fixture(scope="module")
def voice_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The shipped config, SmolLM2 named by the directory this process resolves (the
    server's fresh cache would convert it again)."""
    import yaml
    from omni_ar.models import packaged_model_ready, resolve_model

    if not packaged_model_ready("smollm2"):
        pytest.skip("SmolLM2 is not pulled (`hatch run setup`)")
    smollm2 = str(resolve_model("smollm2"))
    cfg = yaml.safe_load(CONFIG.read_text())
    for stage in cfg["stages"]:
        if stage.get("options", {}).get("model") == "smollm2":
            stage["options"] = {**stage["options"], "model": smollm2}
    where = tmp_path_factory.mktemp("voice-server")
    path = where / "speech_voice.yaml"
    path.write_text(json.dumps(cfg))
    server = start_server(path, where)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(voice_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{voice_server.url}/v1", api_key="unused", max_retries=0)


def heard(data: bytes) -> str:
    """What the oracle hears in an audio file (read to its end with PyAV)."""
    from omni_speech.oracle import listen

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate
        parts = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]
    samples = np.concatenate(parts).astype(np.float32)
    return listen(samples, rate)


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_speech_endpoint_says_its_input(client: openai.OpenAI, fmt: str) -> None:
    audio = client.audio.speech.create(
        model="speech_voice", voice="dial", input=SAY, response_format=fmt
    )
    assert heard(audio.content) == SAY


def test_streamed_speech_says_its_input(client: openai.OpenAI) -> None:
    with client.audio.speech.with_streaming_response.create(
        model="speech_voice", voice="dial", input=SAY, response_format="wav"
    ) as response:
        chunks = list(response.iter_bytes())
    assert len(chunks) > 1  # streamed, not one body
    assert heard(b"".join(chunks)) == SAY


def test_unknown_voice_is_a_400_naming_the_voice(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="speech_voice", voice="alloy", input=SAY)
    assert "dial" in str(e.value)


def test_spoken_chat_says_its_transcript(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="speech_voice",
        messages=[{"role": "user", "content": "Name one colour."}],
        modalities=["text", "audio"],
        audio={"voice": "dial", "format": "wav"},
        max_tokens=16,
    )
    audio = out.choices[0].message.audio
    assert audio.transcript
    assert heard(base64.b64decode(audio.data)) == audio.transcript.strip()


def test_n_spoken_choices_each_say_their_own_transcript(client: openai.OpenAI) -> None:
    """``n`` with audio: each choice its own answer, its audio (its own id) saying its
    own transcript, whole and streamed (each choice's ``delta.audio`` by index)."""
    kw = {
        "model": "speech_voice",
        "messages": [{"role": "user", "content": "Name one colour."}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "dial", "format": "wav"},
        "max_tokens": 12,
        "n": 2,
        "seed": 3,
        "temperature": 1.0,
    }
    from omni_speech.voice import sayable

    out = client.chat.completions.create(**kw)
    assert [c.index for c in out.choices] == [0, 1]
    ids = set()
    for c in out.choices:
        audio = c.message.audio
        assert audio.transcript and c.message.content is None
        assert heard(base64.b64decode(audio.data)) == sayable(audio.transcript)
        ids.add(audio.id)
    assert len(ids) == 2
    data, said = [b"", b""], ["", ""]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            delta = getattr(c.delta, "audio", None)
            audio = delta.model_dump() if delta is not None else {}
            data[c.index] += base64.b64decode(audio.get("data") or "")
            said[c.index] += audio.get("transcript") or ""
    for i in range(2):
        assert said[i] == out.choices[i].message.audio.transcript  # seeded: the same
        assert heard(data[i]) == sayable(said[i])
