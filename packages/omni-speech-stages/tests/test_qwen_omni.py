"""The speech stages against Qwen2.5-Omni's own ``generate(..., return_audio=True)``:
the same text tokens, the same codec tokens and the same waveform, inline and in worker
processes; text only, and with an image and an audio clip in."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omni_core import Pipeline
from omni_core.stage import StageContext
from omni_speech.testing import png_part, wav_part
from omni_speech.thinker import Thinker
from omni_testing.events import events_of

MAX_TOKENS = 10
MAX_CODES = 48
STREAM_ERROR_BOUND = 1e-3  # relative L2, streamed vs exact, tiny model (measured 1.9e-7)


def config(
    model: str,
    *,
    inline: bool,
    sample: bool = False,
    chunk: int = 0,
    max_chunk: int = 0,
    split: bool = False,
) -> dict:
    """thinker -> talker -> token2wav, or with ``split`` -> code2mel -> mel2wav (the
    vocoder in a process of its own), each stage streamed to the caller."""
    talker = {"model": model, "max_codes": MAX_CODES}
    if not sample:
        talker["sampling"] = {"do_sample": False}
    t2w = {"model": model, "chunk_codes": chunk, "context_codes": 8, "lookahead_codes": 4}
    t2w["max_chunk_codes"] = max_chunk
    stages = [
        {"name": "thinker", "kind": "speech.thinker", "options": {"model": model}},
        {"name": "talker", "kind": "speech.talker", "options": talker},
    ]
    if split:
        stages += [
            {"name": "code2mel", "kind": "speech.code2mel", "options": t2w},
            {"name": "mel2wav", "kind": "speech.mel2wav", "options": {"model": model}},
        ]
    else:
        stages.append({"name": "token2wav", "kind": "speech.token2wav", "options": t2w})
    names = [st["name"] for st in stages]
    for st in stages:
        st["client_stream"] = True
    return {
        "name": "speech_test",
        "ready_timeout_s": 120,
        "mrs": {"enabled": not inline},
        "stages": stages,
        "edges": [
            {"from": a, "to": b, "window": {"size": 1}}
            for a, b in zip(names, names[1:], strict=False)
        ],
    }


def thinker_inputs(model: str, request: dict) -> tuple[Thinker, dict]:
    stage = Thinker(StageContext("thinker", "speech.thinker", {"model": model}))
    stage.load()
    ti = stage.read(request)
    return stage, stage.forward_inputs(ti)


def run_reference(reference, kw: dict, seed: int, sample: bool) -> tuple[list, list, np.ndarray]:
    """(text tokens, codes, waveform) of generate, the codes caught on their way."""
    caught = []
    talker_generate = reference.talker.generate

    def spy(*args, **kwargs):
        out = talker_generate(*args, **kwargs)
        caught.append((out, kwargs["input_ids"].shape[1]))
        return out

    reference.talker.generate = spy
    pad, end = reference.talker.codec_pad_token, reference.talker.codec_eos_token
    try:
        torch.manual_seed(seed)
        # pixel_values go to the thinker alone (unprefixed, generate hands them to the
        # talker too, whose generate refuses them)
        args = {("thinker_" + k if k == "pixel_values" else k): v for k, v in kw.items()}
        seq, wav = reference.generate(
            **args,
            speaker="Chelsie",
            thinker_max_new_tokens=MAX_TOKENS,
            talker_max_new_tokens=MAX_CODES,
            talker_eos_token_id=[pad, end],
            talker_do_sample=sample,
        )
    finally:
        reference.talker.generate = talker_generate
    out, start = caught[0]
    codes = out[0, start:].tolist()
    for k, c in enumerate(codes):
        if c in (pad, end):
            codes = codes[:k]
            break
    return seq[0, kw["input_ids"].shape[1] :].tolist(), codes, wav.numpy()


def wave_events(result) -> list:
    """The events of the stage that speaks: token2wav, or mel2wav when split."""
    return result.by_stage("token2wav") or result.by_stage("mel2wav")


def staged(result) -> tuple[list, list, np.ndarray]:
    assert result.ok, result.error
    text = [t for e in result.by_stage("thinker") for t in e.tokens or []]
    codes = [t for e in result.by_stage("talker") for t in e.tokens or []]
    audio = [e.arrays["audio"] for e in wave_events(result) if "audio" in e.arrays]
    return text, codes, np.concatenate(audio) if audio else np.zeros(0, np.float32)


TEXT = {"prompt": "hello there, how are you today", "max_tokens": MAX_TOKENS, "seed": 11}
MEDIA = {
    "messages": [
        {
            "role": "user",
            "content": [png_part(seed=0), wav_part(), {"type": "text", "text": "what?"}],
        }
    ],
    "max_tokens": MAX_TOKENS,
    "seed": 5,
}


@pytest.mark.parametrize("request_", [TEXT, MEDIA], ids=["text", "image+audio"])
def test_inline_equals_generate(tiny_omni, reference, request_):
    _, kw = thinker_inputs(tiny_omni, request_)
    want_text, want_codes, want_wav = run_reference(reference, kw, request_["seed"], False)
    assert len(want_codes) > 4  # the comparison means something
    with Pipeline(config(tiny_omni, inline=True)) as p:
        text, codes, audio = staged(p.generate([request_])[0])
    assert text == want_text
    assert codes == want_codes
    assert audio.shape == want_wav.shape
    np.testing.assert_allclose(audio, want_wav, rtol=0, atol=1e-5 * np.abs(want_wav).max())


def test_sampled_codes_equal_generate(tiny_omni, reference):
    """generate's talker sampling (top-k, top-p, temperature, repetition penalty) with the
    request's seed gives the same codes; the waveform is token2wav's from that seed."""
    _, kw = thinker_inputs(tiny_omni, TEXT)
    want_text, want_codes, _ = run_reference(reference, kw, TEXT["seed"], True)
    with Pipeline(config(tiny_omni, inline=True, sample=True)) as p:
        text, codes, audio = staged(p.generate([TEXT])[0])
    assert text == want_text
    assert codes == want_codes
    voice = reference.speaker_map["Chelsie"]
    torch.manual_seed(TEXT["seed"])
    with torch.no_grad():
        want = reference.token2wav(
            torch.tensor([codes]), conditioning=voice["cond"], reference_mel=voice["ref_mel"]
        ).numpy()
    np.testing.assert_allclose(audio, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_workers_equal_generate(tiny_omni, reference):
    _, kw = thinker_inputs(tiny_omni, TEXT)
    want_text, want_codes, want_wav = run_reference(reference, kw, TEXT["seed"], False)
    with Pipeline(config(tiny_omni, inline=False)) as p:
        text, codes, audio = staged(p.generate([TEXT])[0])
    assert (text, codes) == (want_text, want_codes)
    np.testing.assert_allclose(audio, want_wav, rtol=0, atol=1e-5 * np.abs(want_wav).max())


def test_streamed_waveform_close_to_exact(tiny_omni):
    """Windows of 8 codes (8 of context, 4 of lookahead) give the exact mode's length, in
    more than one chunk, the first long before the last; their difference is bounded
    (the figure in docs/speech.md)."""
    with Pipeline(config(tiny_omni, inline=True)) as p:
        _, codes, exact = staged(p.generate([TEXT])[0])
    with Pipeline(config(tiny_omni, inline=True, chunk=8)) as p:
        result = p.generate([TEXT])[0]
    _, codes_streamed, streamed = staged(result)
    assert codes_streamed == codes
    chunks = [e for e in result.by_stage("token2wav") if e.arrays["audio"].size]
    assert len(chunks) >= len(codes) // 8 - 1
    offsets = [e.payload["offset"] for e in chunks]
    assert offsets == sorted(offsets) and offsets[0] == 0  # in order, none lost
    assert streamed.shape == exact.shape
    error = np.linalg.norm(streamed - exact) / np.linalg.norm(exact)
    print(f"streamed vs exact: relative L2 {error:.3e}")
    assert error < STREAM_ERROR_BOUND, error


def test_split_token2wav_in_two_processes(tiny_omni, reference):
    """code2mel -> mel2wav, in two worker processes: exact, generate's waveform (within
    float noise); streamed in growing windows, as close to it as token2wav's own stream,
    as long, its chunks in order and none lost."""
    _, kw = thinker_inputs(tiny_omni, TEXT)
    want_text, want_codes, want_wav = run_reference(reference, kw, TEXT["seed"], False)
    with Pipeline(config(tiny_omni, inline=False, split=True)) as p:
        text, codes, exact = staged(p.generate([TEXT])[0])
    assert (text, codes) == (want_text, want_codes)
    np.testing.assert_allclose(exact, want_wav, rtol=0, atol=1e-5 * np.abs(want_wav).max())
    with Pipeline(config(tiny_omni, inline=False, split=True, chunk=8, max_chunk=16)) as p:
        result = p.generate([TEXT])[0]
    _, codes, streamed = staged(result)
    mels = [e for e in result.by_stage("code2mel") if "mel" in e.arrays]
    assert len(codes) > 8 and len(mels) >= 2  # windows of 8, 16, 16, ... codes
    assert sum(e.arrays["mel"].shape[2] for e in mels) == 2 * len(codes)  # 2 frames a code
    assert [e.payload["offset"] for e in mels] == list(
        np.cumsum([0] + [e.arrays["mel"].shape[2] for e in mels[:-1]])
    )
    chunks = [e for e in wave_events(result) if e.arrays.get("audio") is not None]
    sizes = [e.arrays["audio"].size for e in chunks]
    assert [e.payload["offset"] for e in chunks] == [sum(sizes[:k]) for k in range(len(sizes))]
    assert streamed.shape == want_wav.shape
    error = np.linalg.norm(streamed - want_wav) / np.linalg.norm(want_wav)
    assert error < STREAM_ERROR_BOUND, error


def mel_input(rid: str, mel, offset, last: bool = False):
    from omni_core import StageInput
    from omni_core.dataplane.windows import Piece, Window

    arrays, payload = ({}, {}) if mel is None else ({"mel": mel}, {"offset": offset})
    window = Window("code2mel", 0, 0, 0, [Piece(0, None, arrays, payload)], last)
    return StageInput(rid, {}, {"code2mel": window}, first=True, last=last)


def test_mel2wav_refuses_bad_mel_for_its_request_alone(tiny_omni):
    """A piece of the wrong shape or type, or one that does not start where the last
    ended, fails its request with an error naming what; the others are vocoded, and a
    whole stream gives the vocoder's waveform of the whole mel."""
    from omni_speech.mel2wav import Mel2Wav

    stage = Mel2Wav(StageContext("mel2wav", "speech.mel2wav", {"model": tiny_omni}))
    stage.load()
    bins = stage.mel_bins
    mel = np.random.default_rng(0).normal(size=(1, bins, 40)).astype(np.float32)
    bad = {
        "shape": (mel[0], 0, f"expected a float array (1, {bins}, frames), got ({bins}, 40)"),
        "bins": (mel[:, :8], 0, "got (1, 8, 40)"),
        "type": ([1.0, 2.0], 0, "got list"),
        "order": (mel, 8, "a piece at frame 8, expected 0: out of order"),
    }
    batch = [mel_input(rid, m, off) for rid, (m, off, _) in bad.items()]
    batch += [mel_input("ok", mel[:, :, :24], 0), mel_input("ok2", mel, 0, last=True)]
    events = events_of(stage.process(batch))
    errors = {e.request_id: e.message for e in events if hasattr(e, "message")}
    assert set(errors) == set(bad)
    for rid, (_, _, words) in bad.items():
        assert errors[rid].startswith("upstream mel: ") and words in errors[rid], errors[rid]
    assert set(stage.streams) == {"ok", "ok2"}  # the failed ones forgotten
    # a request that spoke nothing (modalities ["text"]) ends without audio, as token2wav's
    (quiet,) = stage.process([mel_input("quiet", None, None, last=True)])
    assert quiet.is_last and not getattr(quiet, "arrays", None)
    rest = list(stage.process([mel_input("ok", mel[:, :, 24:], 24, last=True)]))
    wave = {}
    for e in events + rest:
        if "audio" in getattr(e, "arrays", {}):
            wave.setdefault(e.request_id, []).append(e.arrays["audio"])
    import torch

    with torch.inference_mode():
        whole = stage.vocoder(torch.from_numpy(mel)).reshape(-1).numpy()
    np.testing.assert_array_equal(np.concatenate(wave["ok2"]), whole)
    cut = np.concatenate(wave["ok"])
    assert cut.shape == whole.shape
    assert np.linalg.norm(cut - whole) / np.linalg.norm(whole) < STREAM_ERROR_BOUND


def test_growing_windows_double_up_to_their_cap(tiny_omni):
    """max_chunk_codes: windows of 8, 16, then 24 new codes (the cap), the last what is
    left; each with its context and lookahead; the audio as long as the exact mode's and
    as close to it as fixed windows'."""
    from omni_speech.token2wav import Token2Wav

    codes = {"a": np.random.default_rng(1).integers(0, 60, 60).tolist()}
    common = {"model": tiny_omni, "context_codes": 8, "lookahead_codes": 4}
    exact = Token2Wav(StageContext("token2wav", "speech.token2wav", common))
    exact.load()
    opts = {**common, "chunk_codes": 8, "max_chunk_codes": 24}
    stage = Token2Wav(StageContext("token2wav", "speech.token2wav", opts))
    stage.load()
    sampled, sample = [], stage.sample
    stage.sample = lambda cond, ref, c, noise: (
        sampled.append(c.shape[1]) or sample(cond, ref, c, noise)
    )
    want, got = t2w_run(exact, codes, ["a"])["a"], t2w_run(stage, codes, ["a"])["a"]
    # new codes 8, 16, 24, 12; context 0, 8, 8, 8; lookahead 4, 4, 4, 0
    assert sampled == [12, 28, 36, 20]
    assert got.shape == want.shape
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert error < STREAM_ERROR_BOUND, error


def test_window_velocity_equals_the_dit_forward(tiny_omni):
    """omni_speech.dit.WindowVelocity (what a window's solver steps share built once)
    gives the module's own forward's velocity, guided and not, for a batch of voices."""
    from omni_speech.checkpoint import load_part, load_voices
    from omni_speech.dit import WindowVelocity

    dit = load_part(tiny_omni, "token2wav").code2wav_dit_model
    voices = list(load_voices(tiny_omni).values())
    cond = torch.cat([v.cond for v in voices])
    ref = torch.cat([v.ref_mel for v in voices])
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 64, (len(voices), 20), generator=gen)
    x = torch.randn(len(voices), 40, dit.mel_dim, generator=gen)
    speaker = cond.unsqueeze(1).repeat(1, 40, 1)
    common = {"hidden_states": x, "speaker_embedding": speaker, "condition_vector": ref}
    with torch.inference_mode():
        for guidance in (0.5, 0.0):
            velocity = WindowVelocity(dit, cond, ref, codes, guidance)
            for t in (torch.tensor(0.0), torch.tensor(0.6)):
                if guidance:
                    out = dit(**common, quantized_code=codes, time_step=t, apply_cfg=True)
                    guided, null = torch.chunk(out, 2)
                    want = guided + (guided - null) * guidance
                else:
                    want = dit(**common, quantized_code=codes, time_step=t, apply_cfg=False)
                torch.testing.assert_close(velocity(t, x), want, rtol=0, atol=1e-6)


def test_bad_inputs_fail_alone_naming_the_field(tiny_omni):
    """Garbage audio, a voice the model lacks, audio over its budget: each request fails
    with an error naming its field; the good request beside them completes."""
    garbage = {"type": "input_audio", "input_audio": {"data": "bm90IGF1ZGlv", "format": "wav"}}
    bad_audio = {"messages": [{"role": "user", "content": [garbage]}], "max_tokens": 4}
    bad_voice = {**TEXT, "audio": {"voice": "Nobody"}}
    long_audio = {
        "messages": [{"role": "user", "content": [wav_part(seconds=31)]}],
        "max_tokens": 4,
    }
    too_long = {"prompt": "x" * (16 * 8192 + 1), "max_tokens": 4}
    many = {"messages": [{"role": "user", "content": [garbage] * 9}], "max_tokens": 4}
    eight = {"messages": [{"role": "user", "content": [garbage] * 8}], "max_tokens": 4}
    unsampled = [{**TEXT, "top_k": 5}, {**TEXT, "frequency_penalty": 0.5}]
    off = {**TEXT, "top_k": -1, "logit_bias": {}, "response_format": {"type": "text"}}
    with Pipeline(config(tiny_omni, inline=True)) as p:
        outs = p.generate([bad_audio, TEXT, bad_voice, long_audio, too_long, many, eight])
        refused = p.generate(unsampled)
        assert p.generate([off])[0].ok  # fields set to what they are without them
    # fields the thinker's sampler does not apply: refused, never dropped silently
    assert [r.ok for r in refused] == [False, False]
    assert "field 'top_k': not supported by speech.thinker" in refused[0].error
    assert "field 'frequency_penalty'" in refused[1].error
    assert outs[1].ok
    assert not outs[0].ok and "messages[0].content[0].input_audio.data" in outs[0].error
    assert not outs[2].ok and "audio.voice" in outs[2].error
    assert "Chelsie, Ethan" in outs[2].error
    assert not outs[3].ok and "30 s" in outs[3].error, outs[3].error
    assert not outs[4].ok and "max_prompt_tokens" in outs[4].error
    # nine clips, one past max_media: refused before any is decoded (they are garbage)
    assert not outs[5].ok and "messages[0].content[8]" in outs[5].error
    assert "max_media=8" in outs[5].error
    # eight, at the limit: counted in, then the first is decoded (and refused as garbage)
    assert not outs[6].ok and "content[0].input_audio.data" in outs[6].error


def test_requests_in_flight_together_equal_alone(tiny_omni):
    """Three requests stepped together (max_inflight 4: one forward a step for all of
    them, in the thinker and in the talker's tail) give each the tokens and codes it
    gets alone."""
    prompts = ["hello there", "how are you today, my friend", "a"]
    requests = [{"prompt": p, "max_tokens": MAX_TOKENS, "seed": k} for k, p in enumerate(prompts)]
    cfg = config(tiny_omni, inline=True)
    with Pipeline(cfg) as p:
        alone = [staged(p.generate([r])[0])[:2] for r in requests]
    cfg["mrs"]["defaults"] = {"max_inflight": 4}
    with Pipeline(cfg) as p:
        together = [staged(out)[:2] for out in p.generate(requests)]
    assert together == alone


def t2w_inputs(codes: dict[str, list[int]], last: bool = True, new: bool = True) -> list:
    """Token2wav's inputs: each request's ``codes`` in one window (its first: with the
    talker's speech payload, when ``new``)."""
    from omni_core import StageInput
    from omni_core.dataplane.windows import Piece, Window

    out = []
    for rid, cs in codes.items():
        payload = {"speech": {"speak": True, "voice": "Chelsie", "seed": ord(rid)}} if new else {}
        window = Window("talker", 0, 0, 0, [Piece(0, cs, {}, payload)], last)
        out.append(StageInput(rid, {}, {"talker": window}, first=new, last=last))
    return out


def t2w_run(stage, codes: dict[str, list[int]], rids: list[str]) -> dict[str, np.ndarray]:
    """The audio ``stage`` (a loaded ``Token2Wav``) speaks for requests ``rids``, all
    their ``codes`` handed to one process call."""
    audio: dict[str, list] = {rid: [] for rid in rids}
    for ev in stage.process(t2w_inputs({rid: codes[rid] for rid in rids})):
        if ev is not None and "audio" in getattr(ev, "arrays", {}):
            audio[ev.request_id].append(ev.arrays["audio"])
    for rid in rids:
        stage.end_request(rid)
    return {rid: np.concatenate(a) for rid, a in audio.items()}


def test_token2wav_samples_first_windows_first(tiny_omni):
    """A request's first window is sampled, alone, before a request's later window that
    was ready with it (time to first audio); the later windows of both then share one
    batch."""
    from omni_speech.token2wav import Token2Wav

    opts = {"model": tiny_omni, "chunk_codes": 8, "context_codes": 8, "lookahead_codes": 4}
    stage = Token2Wav(StageContext("token2wav", "speech.token2wav", opts))
    stage.load()
    shapes, sample = [], stage.sample
    stage.sample = lambda cond, ref, c, noise: (
        shapes.append(tuple(c.shape)) or sample(cond, ref, c, noise)
    )
    list(stage.process(t2w_inputs({"a": list(range(24))}, last=False)))
    assert shapes == [(1, 12), (1, 20)]  # a: [0, 8) and [8, 16); [16, 24) waits for 28
    shapes.clear()
    later = t2w_inputs({"a": list(range(8))}, last=False, new=False)
    list(stage.process(later + t2w_inputs({"b": list(range(20))}, last=False)))
    # b's first window [0, 8) (with 4 of lookahead) alone; then a's [16, 24) and b's
    # [8, 16), 8 of context and 4 of lookahead each, in one batch
    assert shapes == [(1, 12), (2, 20)]


class _Input:
    """The little of a StageInput the thinker's generate reads."""

    cancelled = False

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def segment(self, tokens, payload=None, arrays=None, is_last=False):
        return tokens, is_last


def test_thinker_steps_requests_in_one_forward(tiny_omni):
    stage, _ = thinker_inputs(tiny_omni, TEXT)
    a = stage.generate(_Input("a"), stage.read({**TEXT, "ignore_eos": True}))
    b = stage.generate(_Input("b"), stage.read({**TEXT, "prompt": "b", "ignore_eos": True}))
    got: dict = {"a": [], "b": []}
    for (ta, _), (tb, _) in zip(a, b, strict=True):  # advanced in turn, as max_inflight does
        got["a"] += ta
        got["b"] += tb
    assert len(got["a"]) == len(got["b"]) == MAX_TOKENS
    assert stage.batch.forwards == MAX_TOKENS - 1  # one forward a step for both
    assert not stage.batch.members  # both left the batch


def test_token2wav_samples_requests_together_as_alone(tiny_omni):
    """Windows of several requests sampled in one batch (max_batch_size 8) give each
    request the waveform it gets alone (to float noise), chunks in order."""
    requests = [
        {"prompt": p, "max_tokens": MAX_TOKENS, "seed": k} for k, p in enumerate(["hi", "ok"])
    ]
    cfg = config(tiny_omni, inline=True, chunk=8)
    with Pipeline(cfg) as p:
        alone = [staged(p.generate([r])[0]) for r in requests]
    cfg["mrs"]["defaults"] = {"max_inflight": 4}
    for stage in cfg["stages"]:
        if stage["kind"] == "speech.token2wav":
            stage["max_batch_size"] = 8
    with Pipeline(cfg) as p:
        together = [staged(out) for out in p.generate(requests)]
    for (t1, c1, a1), (t2, c2, a2) in zip(alone, together, strict=True):
        assert (t1, c1) == (t2, c2)
        np.testing.assert_allclose(a2, a1, rtol=0, atol=1e-5 * max(np.abs(a1).max(), 1e-30))


def test_token2wav_batches_windows_of_several_requests(tiny_omni):
    """Two requests' windows handed to one process call: one DiT forward a solver step
    for both (a batch of 2, with guidance 4 rows), and each request's audio the same as
    when it is processed alone."""
    from omni_speech.token2wav import Token2Wav

    rng = np.random.default_rng(0)
    codes = {rid: rng.integers(0, 60, 20).tolist() for rid in ("a", "b")}

    def run(stage, rids):
        return t2w_run(stage, codes, rids)

    opts = {"model": tiny_omni, "chunk_codes": 8, "context_codes": 8, "lookahead_codes": 4}
    stage = Token2Wav(StageContext("token2wav", "speech.token2wav", opts))
    stage.load()
    alone = {**run(stage, ["a"]), **run(stage, ["b"])}
    batches = []  # the rows of each velocity (its last projection's output)
    stage.dit.proj_out.register_forward_hook(lambda m, a, out: batches.append(out.shape[0]))
    together = run(stage, ["a", "b"])
    assert max(batches) == 4  # two requests, each conditioned and unconditioned
    for rid in ("a", "b"):
        scale = np.abs(alone[rid]).max()
        assert scale > 0 and together[rid].shape == alone[rid].shape
        np.testing.assert_allclose(together[rid], alone[rid], rtol=0, atol=1e-5 * scale)
    assert np.abs(together["a"] - together["b"]).max() > 1e-3 * scale  # not the same audio
