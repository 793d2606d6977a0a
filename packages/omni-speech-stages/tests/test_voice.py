"""The embedded voice (``tiny-dial-voice``) and its oracle: the oracle reads the code
back; the trained talker's audio of held-out text is read back exactly; corrupted audio
and corrupted models are caught; the stages stream what they would say whole; the
config runs end to end (``omni run --out`` writes a WAV the oracle reads)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from omni_ar.errors import RequestError
from omni_core import StageInput, load_config
from omni_core.dataplane.windows import Piece, Window
from omni_core.stage import StageContext
from omni_speech.oracle import HELD_OUT, UNHEARD, listen, quality_rate, wav_samples
from omni_speech.voice import (
    GAP,
    SAMPLE_RATE,
    SYMBOLS,
    VOICES,
    SayableStream,
    frames_of,
    render,
    sayable,
    speaker_rhythm,
    symbols_of,
)
from omni_speech.voice_net import TalkerNet, load_talker
from omni_speech.voice_stages import VoiceIntake, VoiceTalker, VoiceVocoder, speech_fields

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "speech_voice.yaml"
EVERY = "".join(chr(32 + s) for s in range(SYMBOLS))  # every character the voice says


@pytest.fixture(scope="module")
def talker() -> Iterator[TalkerNet]:
    """The shipped talker, on one torch thread as its stage runs it (a small net: more
    threads only wait on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_talker()[0]
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smollm2() -> str:
    """SmolLM2's directory as this process resolves it (module-scoped: before the tests'
    own empty cache is set, which would convert it again, a minute)."""
    from omni_ar.models import packaged_model_ready, resolve_model

    if not packaged_model_ready("smollm2"):
        pytest.skip("SmolLM2 is not pulled (`hatch run setup`)")
    return str(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def voice_config(smollm2: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``configs/speech_voice.yaml`` as shipped, SmolLM2 named by its directory."""
    import yaml

    cfg = yaml.safe_load(CONFIG.read_text())
    for stage in cfg["stages"]:
        if stage.get("options", {}).get("model") == "smollm2":
            stage["options"] = {**stage["options"], "model": smollm2}
    path = tmp_path_factory.mktemp("voice") / "speech_voice.yaml"
    path.write_text(json.dumps(cfg))
    return path


def spoken(net: TalkerNet, text: str) -> np.ndarray:
    return render(frames_of(*net.say(text)))


def rate(net: TalkerNet, texts: tuple[str, ...] = HELD_OUT) -> float:
    return sum(listen(spoken(net, t), SAMPLE_RATE) == t for t in texts) / len(texts)


# --------------------------------------------------------------------------- the code


@pytest.mark.parametrize(("tone", "gap"), [(3, 1), (8, 8)])
def test_oracle_reads_the_code(tone: int, gap: int) -> None:
    """Every character, and letters said twice, at the shortest and longest rhythm."""
    for text in (EVERY, "aabbb  ~~", "Hello, world!"):
        text = sayable(text)
        n = len(text)
        frames = frames_of(symbols_of(text), [tone] * n, [gap] * n)
        assert listen(render(frames), SAMPLE_RATE) == text
        assert listen(0.05 * render(frames), SAMPLE_RATE) == text  # any loudness


def test_sayable() -> None:
    assert sayable("  Héllo,\n\tworld!  日本 ") == "Hello, world!"
    assert sayable("日本") == ""
    text = "  A  café\n\nat 10:30 —  ok?  "
    stream = SayableStream()
    pieces = "".join(stream.add(text[i : i + 3]) for i in range(0, len(text), 3))
    assert pieces == sayable(text) == "A cafe at 10:30 ok?"


def test_render_in_pieces_is_render_whole() -> None:
    frames = frames_of(symbols_of("abba, 12"), *speaker_rhythm("abba, 12"))
    whole = render(frames)
    for step in (1, 7, 20):
        parts = [
            render(
                frames[i : i + step],
                i,
                frames[i - 1] if i else GAP,
                frames[i + step] if i + step < len(frames) else GAP,
            )
            for i in range(0, len(frames), step)
        ]
        assert np.array_equal(np.concatenate(parts), whole)


# --------------------------------------------------------------------------- the model


def test_talker_says_held_out_text(talker: TalkerNet) -> None:
    """The shipped talker on text it never saw: the oracle hears it back, and the
    talker keeps the reference speaker's rhythm (which it had to learn from context)."""
    text = "Please call me back at 555-0199 before 10:30."
    assert text in HELD_OUT
    assert listen(spoken(talker, text), SAMPLE_RATE) == text
    assert rate(talker) >= 0.95
    right = chars = 0
    for t in HELD_OUT:
        _, tone, gap = talker.say(t)
        want_tone, want_gap = speaker_rhythm(t)
        right += sum(
            a == b and c == d for a, b, c, d in zip(tone, want_tone, gap, want_gap, strict=True)
        )
        chars += len(t)
    assert right / chars >= 0.95


def test_held_out_text_is_never_trained() -> None:
    spec = importlib.util.spec_from_file_location(
        "train_voice", REPO / "tools/train-voice/train.py"
    )
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    import random

    rng = random.Random(0)  # the shipped run's seed; its first 2000 texts
    texts = [train.training_text(rng) for _ in range(2000)]
    assert set("".join(texts)) == set(EVERY)
    assert not [h for h in HELD_OUT if any(h in t for t in texts)]


def test_oracle_catches_corrupted_models(talker: TalkerNet) -> None:
    torch.manual_seed(0)
    assert rate(TalkerNet(**talker.config).eval()) == 0.0  # untrained
    swapped = TalkerNet(**talker.config)
    swapped.load_state_dict(talker.state_dict())
    a, e = ord("a") - 32, ord("e") - 32
    with torch.no_grad():  # the symbol head's rows of "a" and "e" swapped
        for p in (swapped.symbol.weight, swapped.symbol.bias):
            p[[a, e]] = p[[e, a]]
    swapped.eval()
    for text in HELD_OUT:
        heard = listen(spoken(swapped, text), SAMPLE_RATE)
        assert (heard == text) == ("a" not in text and "e" not in text)


def test_oracle_catches_corrupted_audio(talker: TalkerNet) -> None:
    text = "Meet me at the station on Friday; bring an umbrella."
    x = spoken(talker, text)
    assert listen(x, SAMPLE_RATE) == text
    rng = np.random.default_rng(0)
    pitched = np.interp(np.arange(0, len(x), 1.03), np.arange(len(x)), x)  # 3% higher
    assert listen(pitched, SAMPLE_RATE) != text
    assert listen(x + rng.normal(0, 0.3, x.shape), SAMPLE_RATE) != text  # noise
    sym, tone, gap = talker.say(text)
    run_together = frames_of(sym, tone, [0] * len(sym))  # no silence between characters
    heard = listen(render(run_together), SAMPLE_RATE)
    assert heard != text and UNHEARD in heard
    cut = np.concatenate([x[: len(x) // 3], x[len(x) // 2 :]])  # a stretch lost
    assert listen(cut, SAMPLE_RATE) != text
    assert listen(np.zeros(16000), SAMPLE_RATE) == ""


# --------------------------------------------------------------------------- the stages


def window(edge: str, index: int, pieces: list[Piece], last: bool) -> Window:
    return Window(edge, index, 0, 0, pieces, last)


def test_talker_stage_streams_what_it_says_whole(talker: TalkerNet) -> None:
    """Text deltas in windows of one token (an event cut across windows repeats its
    payload: read once) give the frames of the whole text, text that only follows."""
    stage = VoiceTalker(StageContext("talker", "speech.voice_talker", {}))
    stage.load()
    text = "  Hello there, it's 9:45 -- time to go!  "
    deltas = [text[i : i + 4] for i in range(0, len(text), 4)]
    frames: list[int] = []
    said = ""
    index = 0
    for seq, delta in enumerate(deltas):
        cut = 2 if seq % 3 == 0 else 1  # this event cut across two windows
        for k in range(cut):
            last = seq == len(deltas) - 1 and k == cut - 1
            piece = Piece(seq, [seq], {}, {"text": delta})
            inp = StageInput(
                "r",
                {},
                {"postprocess": window("postprocess", index, [piece], last)},
                index == 0,
                last,
            )
            index += 1
            for ev in stage.process([inp]):
                frames += ev.tokens
                said += ev.payload["said"]
                assert ev.is_last == last
    assert said == sayable(text)
    assert frames == frames_of(*talker.say(sayable(text)))
    # modalities without audio: nothing said, the request still ends
    inp = StageInput(
        "q",
        {"modalities": ["text"]},
        {"postprocess": window("postprocess", 0, [Piece(0, [1], {}, {"text": "hi"})], True)},
        True,
        True,
    )
    (ev,) = stage.process([inp])
    assert ev.tokens == [] and ev.is_last


def test_vocoder_stage_streams_what_it_renders_whole(talker: TalkerNet) -> None:
    frames = frames_of(*talker.say("Over 1,000,000 people came."))
    stage = VoiceVocoder(StageContext("vocoder", "speech.voice_vocoder", {}))
    out = []
    windows = [frames[i : i + 13] for i in range(0, len(frames), 13)]
    for i, chunk in enumerate(windows):
        last = i == len(windows) - 1
        inp = StageInput(
            "r", {}, {"talker": window("talker", i, [Piece(i, chunk, {}, {})], last)}, i == 0, last
        )
        for ev in stage.process([inp]):
            assert ev.payload["sample_rate"] == SAMPLE_RATE
            assert ev.payload["offset"] == sum(len(a) for a in out)
            out.append(ev.arrays["audio"])
    assert np.array_equal(np.concatenate(out), render(frames))
    # nothing said: a last segment without a rate (speech.audio_encode writes no file)
    inp = StageInput(
        "q", {}, {"talker": window("talker", 0, [Piece(0, [], {}, {})], True)}, True, True
    )
    (ev,) = stage.process([inp])
    assert ev.payload == {} and ev.is_last and not getattr(ev, "arrays", None)


def test_speech_fields() -> None:
    limit = 4096
    plain = {"prompt": "hi", "max_tokens": 5}
    assert speech_fields(plain, "Say: {input}", limit) == plain
    r = speech_fields(
        {
            "input": "Hi, 42!",
            "voice": "dial",
            "response_format": "mp3",
            "modalities": ["text", "audio"],
        },
        "Say: {input}",
        limit,
    )
    assert r == {
        "prompt": "Say: Hi, 42!",
        "structured_outputs": {"choice": ["Hi, 42!"]},
        "max_tokens": len("Hi, 42!") + 1,
    }
    assert speech_fields(
        {"prompt": "x", "response_format": {"type": "text"}}, "{input}", limit
    ) == {
        "prompt": "x",
        "response_format": {"type": "text"},
    }
    bad = [
        ({"input": "hi", "voice": "alloy"}, "field 'voice': voice 'alloy' is not one of"),
        ({"input": "hi", "audio": {"voice": "x"}}, "field 'audio.voice'"),
        ({"input": "hi", "response_format": "ogg"}, "field 'response_format'"),
        ({"input": "hi", "audio": {"format": "ogg"}}, "field 'audio.format'"),
        ({"input": "hi", "prompt": "x"}, "field 'prompt': not with 'input'"),
        ({"input": "日本"}, "field 'input'"),
        ({"input": 3}, "field 'input'"),
        ({"input": "x" * 5000}, "field 'input'"),
        ({"prompt": "x", "modalities": ["video"]}, "field 'modalities'"),
        ({"prompt": "x", "audio": {"speed": 2}}, "field 'audio'"),
    ]
    for request, message in bad:
        with pytest.raises(RequestError, match=message.replace("(", r"\(")):
            speech_fields(request, "{input}", limit)
    assert VOICES[0] in str(
        pytest.raises(RequestError, speech_fields, {"voice": "x"}, "{input}", limit).value
    )


def test_intake_stage(smollm2: str) -> None:
    """``speech.voice_intake`` inline: ``input`` held to itself, a bad field alone fails."""
    stage = VoiceIntake(StageContext("intake", "speech.voice_intake", {"model": smollm2}))
    stage.load()
    good = StageInput("a", {"input": "Hi 2 you."}, {}, True, True)
    bad = StageInput("b", {"input": "Hi", "voice": "alloy"}, {}, True, True)
    plain = StageInput("c", {"prompt": "Hi", "unknown": 1}, {}, True, True)
    ok, refused, unknown = stage.process([good, bad, plain])
    assert ok.request_id == "a" and ok.tokens
    assert ok.payload["params"]["structured_outputs"] == {"choice": ["Hi 2 you."]}
    assert refused.request_id == "b" and "field 'voice'" in refused.message
    assert unknown.request_id == "c" and "field 'unknown'" in unknown.message


# --------------------------------------------------------------------------- end to end


def test_omni_run_writes_a_wav_the_oracle_reads(voice_config: Path, tmp_path: Path) -> None:
    """``omni run configs/speech_voice.yaml --prompt ... --out``: SmolLM2's reply,
    streamed as text, is what the oracle hears in the WAV written."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_core.cli",
            "run",
            str(voice_config),
            "--prompt",
            "Say hello to a friend.",
            "--set",
            "max_tokens=16",
            "--json",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    text = "".join(e["payload"].get("text", "") for e in events if e.get("stage") == "postprocess")
    (wav,) = out.glob("*.wav")
    samples, rate_hz = wav_samples(wav.read_bytes())
    assert rate_hz == SAMPLE_RATE
    assert sayable(text) and listen(samples, rate_hz) == sayable(text)


def test_quality_rate_says_input_exactly(voice_config: Path) -> None:
    """The quality measure on a few held-out texts (``input``: said as it is), the
    stages inline, and one prompt: every one heard back."""
    cfg = load_config(voice_config)
    cfg = msgspec.structs.replace(cfg, mrs=msgspec.structs.replace(cfg.mrs, enabled=False))
    from omni_core import Pipeline

    with Pipeline(cfg) as pipe:
        res = quality_rate(HELD_OUT[:3], (), pipe=pipe)
    assert res["quality_rate"] == 1.0, res
    assert res["quality_asked"] == 3 and res["quality_char_error_rate"] == 0.0
