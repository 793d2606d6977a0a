"""Synthetic stages, registered under ``omni.stages`` like any plug-in.

They hold a request for a set time (``sleep``), emit counted tokens or arrays, transform
what they receive, and fail on demand, so the runtime can be tested and measured without
a model. Each records when it started and ended a trigger in its payload, so tests can
prove from timestamps that stages overlap.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
from omni_core.errors import UserInputError
from omni_core.stage import Stage, StageEvent, StageInput


class SourceOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``synthetic.source``'s options."""

    tokens: int = 8  # default count when the request has no "n"
    segment: int = 4  # tokens per emitted segment
    delay_s: float = 0.0  # sleep per segment
    array_bytes: int = 0  # also attach an array of this many bytes per segment


class TokenSource(Stage):
    """Emits ``request["n"]`` tokens (``start + i``) in segments, like a decode loop."""

    Options = SourceOptions

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        o = self.options
        for inp in batch:
            n = int(inp.request.get("n", o.tokens))
            start = int(inp.request.get("start", 0))
            seg = max(1, o.segment)
            for lo in range(0, n, seg):
                if o.delay_s:
                    time.sleep(o.delay_s)
                toks = list(range(start + lo, start + min(n, lo + seg)))
                arrays = {}
                if o.array_bytes:
                    arrays["data"] = np.full(o.array_bytes, lo % 251, dtype=np.uint8)
                yield inp.segment(
                    toks, arrays=arrays, is_last=lo + seg >= n, payload={"at": time.time()}
                )
            if n == 0:
                yield inp.segment([], is_last=True)


class MapOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``synthetic.map``'s options."""

    scale: int = 1  # each token t becomes t * scale + offset
    offset: int = 0
    delay_s: float = 0.0  # hold each trigger this long


class TokenMap(Stage):
    """Per window: re-emits the new tokens mapped by ``t * scale + offset``, plus timing."""

    Options = MapOptions

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        o = self.options
        for inp in batch:
            t0 = time.time()
            if o.delay_s:
                time.sleep(o.delay_s)
            for edge, w in sorted(inp.windows.items()):
                yield inp.segment(
                    [t * o.scale + o.offset for t in w.new_tokens],
                    is_last=inp.last,
                    payload={
                        "edge": edge,
                        "window": w.index,
                        "context": w.tokens[: w.overlap],
                        "pid": os.getpid(),
                        "start": t0,
                        "end": time.time(),
                    },
                )


class ReplayableMap(TokenMap):
    """``TokenMap`` declared idempotent: after a crash its lost requests are replayed."""

    idempotent = True


class SleepOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``synthetic.sleep``'s options."""

    hold_s: float = 0.01  # how long each request is held
    # each request is first held until a file of this path exists (a test's
    # :class:`~omni_testing.faults.Gate`), the others in flight given turns meanwhile
    until_file: str = ""


class Sleep(Stage):
    """Holds each request for ``hold_s`` then passes a one-token segment on (pipeline bench)."""

    Options = SleepOptions

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | None]:
        gate = self.options.until_file
        for inp in batch:
            while gate and not os.path.exists(gate):
                time.sleep(0.005)
                yield None  # a turn: other batches run, a cancelled one ends
            t0 = time.time()
            time.sleep(self.options.hold_s)
            tokens = [t for w in inp.windows.values() for t in w.new_tokens] if inp.windows else [0]
            steps = [p.step for w in inp.windows.values() for p in w.pieces if p.step is not None]
            payload = {"start": t0, "end": time.time(), "pid": os.getpid(), "batch": len(batch)}
            if steps:
                payload["steps"] = steps
            yield inp.segment(tokens, is_last=inp.last, payload=payload)


class SpinOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``synthetic.spin``'s options."""

    # iterations per input, unless the request says ("work"); the default is about 50 ms
    # on one core of the 2-core CI machine
    work: int = 700_000


def spin(work: int) -> int:
    """``work`` steps of a linear congruential chain in pure Python: CPU time on the
    calling thread only (the GIL held throughout, no sleep, no native threads)."""
    x = 1
    for _ in range(work):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
    return x


class Spin(Stage):
    """Busy on one thread for ``work`` iterations per input, then passes the input's new
    tokens on (``[0]`` as a source), with its pid and when it started and ended: a
    CPU-bound stage, whose throughput only more processes (replicas) can raise. Declared
    idempotent: a crashed worker's requests are replayed."""

    Options = SpinOptions
    idempotent = True

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            t0 = time.time()
            check = spin(int(inp.request.get("work", self.options.work)))
            tokens = [t for w in inp.windows.values() for t in w.new_tokens] if inp.windows else [0]
            payload = {"pid": os.getpid(), "start": t0, "end": time.time(), "check": check}
            yield inp.segment(tokens, is_last=inp.last, payload=payload)


class Join(Stage):
    """Fan-in: sums the tokens of every inbound window, position by position."""

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            parts = [w.new_tokens for _, w in sorted(inp.windows.items())]
            width = max((len(p) for p in parts), default=0)
            summed = [sum(p[i] for p in parts if i < len(p)) for i in range(width)]
            yield inp.segment(summed, is_last=inp.last, payload={"edges": sorted(inp.windows)})


class ArrayOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``synthetic.array_source``'s options."""

    nbytes: int = 1 << 20  # bytes per array, unless the request says ("nbytes")
    count: int = 1  # arrays per request


class ArraySource(Stage):
    """Emits ``count`` arrays of ``request.get("nbytes", nbytes)`` bytes (data-plane bench);
    torch tensors on ``request["device"]`` when given."""

    Options = ArrayOptions

    def load(self) -> None:
        self._cache: dict[tuple[int, str | None], Any] = {}

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            nbytes = int(inp.request.get("nbytes", self.options.nbytes))
            count = int(inp.request.get("count", self.options.count))
            device = inp.request.get("device")  # e.g. "cuda": a torch tensor there
            arr = self._cache.get((nbytes, device))
            if arr is None:
                arr = np.arange(nbytes, dtype=np.uint8)
                if device:
                    import torch

                    arr = torch.from_numpy(arr).to(device)
                self._cache[(nbytes, device)] = arr
            for i in range(count):
                yield inp.segment(None, arrays={"data": arr}, is_last=i == count - 1)


class ArraySink(Stage):
    """Reads what arrives and reports the byte count, a cheap check (first and last byte)
    and a CRC-32 of every byte, in arrival order."""

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            total, check, crc = 0, 0, 0
            for w in inp.windows.values():
                for p in w.pieces:
                    for a in p.arrays.values():
                        total += a.nbytes
                        check += int(a[0]) + int(a[-1]) if a.size else 0
                        crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8), crc)
            payload = {"bytes": total, "check": check, "crc": crc}
            yield inp.segment(None, payload=payload, is_last=inp.last)


class FailOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``synthetic.faulty``'s options: faults at load time."""

    fail_on_load: bool = False  # load raises
    exit_on_load: bool = False  # the worker process exits during load
    fail_on_load_if: str = ""  # load raises while a file of this path exists
    imports: list[str] = []  # modules the zygote preloads and load imports (one may be missing)


class Faulty(Stage):
    """Passes tokens on; raises for a request with ``"fail": true`` (a
    :class:`~omni_core.errors.UserInputError` on ``"refuse"``), crashes on ``"crash"``,
    emits what cannot be decoded on ``"undecodable"``, sleeps ``"hang_s"`` in one step."""

    Options = FailOptions

    @classmethod
    def preload_modules(cls, options: dict[str, Any]) -> tuple[str, ...]:
        return tuple(options.get("imports", ()))

    def load(self) -> None:
        for module in self.options.imports:
            importlib.import_module(module)
        if self.options.fail_on_load:
            raise RuntimeError("synthetic load failure")
        if self.options.exit_on_load:
            os._exit(7)
        if self.options.fail_on_load_if and os.path.exists(self.options.fail_on_load_if):
            raise RuntimeError(f"synthetic load failure ({self.options.fail_on_load_if} exists)")

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            if inp.request.get("fail"):
                raise ValueError(f"synthetic failure on request {inp.request_id}")
            if inp.request.get("crash"):
                os._exit(9)
            if inp.request.get("bad_output"):
                yield inp.segment([1], payload={"x": object()}, is_last=True)
                continue
            if inp.request.get("reject"):
                yield inp.fail("request rejected: field 'reject' is set")
                continue
            if inp.request.get("refuse"):  # the request's fault, raised
                raise UserInputError("field 'refuse': this stage refuses such requests")
            if inp.request.get("undecodable"):  # encodes, but no receiver can decode it
                yield inp.segment([1], payload={0: "x"}, is_last=True)  # type: ignore[dict-item]
                continue
            if inp.request.get("hang_s"):  # stuck inside one step (the GIL released)
                time.sleep(float(inp.request["hang_s"]))
            toks = [t for w in inp.windows.values() for t in w.new_tokens]
            yield inp.segment(toks, is_last=inp.last)


class Environment(Stage):
    """Reports the worker's pid and the environment variables named in ``request["env"]``."""

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            names = inp.request.get("env", ["CUDA_VISIBLE_DEVICES"])
            env = {n: os.environ.get(n) for n in names}
            yield inp.segment([], is_last=True, payload={"pid": os.getpid(), "env": env})


class BurstOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``synthetic.burst``'s options."""

    count: int = 1000  # events per request
    nbytes: int = 1024  # payload bytes per event
    chunk: int = 1  # events per yield (a list when > 1), like a batched decode step


class Burst(Stage):
    """Emits ``count`` events of ``nbytes`` as fast as it can (``chunk`` per yield): inline
    bytes in the payload
    below the shared-memory threshold, else an array through shared memory (ipc bench).
    The first event carries ``t0``, the time the burst started."""

    Options = BurstOptions

    def load(self) -> None:
        self._blobs: dict[int, tuple[bytes, np.ndarray]] = {}

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | list[StageEvent]]:
        for inp in batch:
            count = int(inp.request.get("count", self.options.count))
            nbytes = int(inp.request.get("nbytes", self.options.nbytes))
            inline = bool(inp.request.get("inline", nbytes < 65536))
            blob = self._blobs.get(nbytes)
            if blob is None:
                arr = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
                blob = self._blobs[nbytes] = (arr.tobytes(), arr)
            chunk = max(1, int(inp.request.get("chunk", self.options.chunk)))
            t0 = time.time()
            for lo in range(0, count, chunk):  # one step: a list of ``chunk`` events
                hi = min(lo + chunk, count)
                if inline:
                    data = blob[0]
                    step = [inp.segment([i], payload={"data": data}) for i in range(lo, hi)]
                else:
                    arrays = {"data": blob[1]}
                    step = [inp.segment([i], arrays=arrays) for i in range(lo, hi)]
                if lo == 0:
                    step[0].payload["t0"] = t0
                step[-1].is_last = hi == count
                if chunk == 1:
                    yield step[0]
                else:
                    yield step


class Count(Stage):
    """Counts the units and bytes it receives; at the end reports them with the burst's
    ``t0`` and the time the last unit arrived."""

    def load(self) -> None:
        self._acc: dict[str, list[float]] = {}

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        for inp in batch:
            acc = self._acc.setdefault(inp.request_id, [0, 0, 0.0])
            for w in inp.windows.values():
                payloads = w.payloads
                if acc[0] == 0 and payloads and "t0" in payloads[0]:
                    acc[2] = payloads[0]["t0"]
                acc[0] += w.units
                acc[1] += sum(len(p["data"]) for p in payloads if "data" in p)
                acc[1] += sum(a.nbytes for arrays in w.piece_arrays for a in arrays.values())
            if inp.last:
                count, nbytes, t0 = self._acc.pop(inp.request_id)
                yield inp.segment(
                    None,
                    is_last=True,
                    payload={"count": count, "bytes": nbytes, "t0": t0, "t_end": time.time()},
                )

    def end_request(self, request_id: str) -> None:
        self._acc.pop(request_id, None)


class Rendezvous(Stage):
    """Admits a request, then yields ``None`` (a turn for the others in flight) until
    ``request["expect"]`` requests are admitted or 5 s passed; reports how many it saw:
    the shape of a stage over a continuous-batching engine."""

    def load(self) -> None:
        self.admitted: set[str] = set()

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | None]:
        for inp in batch:
            self.admitted.add(inp.request_id)
            deadline = time.monotonic() + 5.0
            while len(self.admitted) < int(inp.request["expect"]):
                if time.monotonic() > deadline:
                    break
                yield None
            yield inp.segment([len(self.admitted)], is_last=True)

    def end_request(self, request_id: str) -> None:
        pass  # admitted requests stay counted: the test asks who was there at once


class PreviewOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``synthetic.previews``'s options."""

    steps: int = 20  # previews before the final image
    step_s: float = 0.0  # sleep per step
    size: int = 8  # previews are size x size x 3 uint8; the final image 2x that


class Previews(Stage):
    """A stand-in sampling loop: a preview image every step, then the final image."""

    Options = PreviewOptions

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        o = self.options
        for inp in batch:
            steps = int(inp.request.get("steps", o.steps))
            for step in range(steps):
                if o.step_s:
                    time.sleep(o.step_s)
                img = np.full((o.size, o.size, 3), step % 256, dtype=np.uint8)
                yield inp.image(step, arrays={"image": img})
            final = np.full((2 * o.size, 2 * o.size, 3), 255, dtype=np.uint8)
            yield inp.image(steps, arrays={"image": final}, is_last=True)


class EndProbe(Stage):
    """Emits ``request["n"]`` one-token segments, each after a ``step_s`` sleep inside the
    step; counts ``end_request`` calls made while a step runs or from another thread
    than the one running ``process`` (both must be zero) and reports them each segment."""

    def load(self) -> None:
        self.in_step = False
        self.stage_thread: int | None = None
        self.ends = 0
        self.overlaps = 0

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent]:
        self.stage_thread = threading.get_ident()
        for inp in batch:
            n = int(inp.request.get("n", 4))
            for i in range(n):
                self.in_step = True
                time.sleep(float(inp.request.get("step_s", 0.005)))
                self.in_step = False
                payload = {"ends": self.ends, "overlaps": self.overlaps}
                yield inp.segment([i], payload=payload, is_last=i == n - 1)

    def end_request(self, request_id: str) -> None:
        self.ends += 1
        if self.in_step or threading.get_ident() != self.stage_thread:
            self.overlaps += 1


class StepsOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``synthetic.steps``'s options."""

    steps: int = 10  # steps per request (the request may say: "steps")
    step_s: float = 0.02  # sleep per step
    fail: str = ""  # "pause" or "resume": that call raises


class Steps(Stage):
    """A preemptible sampling loop: each step sleeps ``step_s`` and yields one token for
    every request of the batch (its step number); the last one reports how often the
    batch was paused and resumed. The runtime may pause it between steps for a better
    request (``scheduler_policy: priority``)."""

    Options = StepsOptions
    preemptible = True

    def load(self) -> None:
        self.pauses: dict[str, int] = {}
        self.resumes: dict[str, int] = {}
        self.paused: set[str] = set()

    def process(self, batch: list[StageInput]) -> Iterator[StageEvent | list[StageEvent]]:
        steps = max(int(inp.request.get("steps", self.options.steps)) for inp in batch)
        for step in range(steps):
            if self.paused & {inp.request_id for inp in batch}:
                raise RuntimeError("a paused batch was advanced")
            time.sleep(self.options.step_s)
            events = []
            for inp in batch:
                n = int(inp.request.get("steps", self.options.steps))
                if step < n - 1:
                    events.append(inp.segment([step]))
                elif step == n - 1:
                    rid = inp.request_id
                    payload = {"pauses": self.pauses.get(rid, 0), "end": time.time()}
                    payload["resumes"] = self.resumes.get(rid, 0)
                    events.append(inp.segment([step], payload=payload, is_last=True))
            yield events

    def pause(self, request_ids: list[str]) -> None:
        if self.options.fail == "pause":
            raise RuntimeError("pause failed on purpose")
        for rid in request_ids:
            self.pauses[rid] = self.pauses.get(rid, 0) + 1
        self.paused.update(request_ids)

    def resume(self, request_ids: list[str]) -> None:
        if self.options.fail == "resume":
            raise RuntimeError("resume failed on purpose")
        for rid in request_ids:
            self.resumes[rid] = self.resumes.get(rid, 0) + 1
        self.paused.difference_update(request_ids)

    def end_request(self, request_id: str) -> None:
        self.pauses.pop(request_id, None)
        self.resumes.pop(request_id, None)
        self.paused.discard(request_id)
