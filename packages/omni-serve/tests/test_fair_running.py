"""The fair gate of ``--max-running-requests`` (``omni_serve.shares.Shares.running``): at
most N pipeline requests run, a key alone may run all N, with other keys active each runs
at most its share (N over them, rounded up), a freed place goes to the key with the fewest
running, a key between two requests keeps its share for ``ANTICIPATE_S``, and a request
cancelled while it waits (or as its turn comes) gives its place on. Then against a real
server: a key's request passes another key's earlier ones."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from omni_serve import shares as shares_mod
from omni_serve.keys import ApiKey
from omni_serve.metrics import ServerMetrics
from omni_serve.shares import ClientShares, SharedPipeline, Shares

from .conftest import intake_then, slow, start_server, stop_server
from .test_fair_shares import sample, wait_for

FLOOD, CALM = ApiKey("flood", "f" * 40), ApiKey("calm", "c" * 40)
THIRD = ApiKey("third", "t" * 40)


def gate(max_running: int) -> Shares:
    return Shares([FLOOD, CALM, THIRD], None, ServerMetrics(None), max_running)


class Runner:
    """Requests through the gate, each held running until :meth:`end`."""

    def __init__(self, shares: Shares) -> None:
        self.shares = shares
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.started: list[str] = []
        self.ends: dict[str, asyncio.Event] = {}

    def start(self, name: str, key: ApiKey) -> None:
        self.ends[name] = asyncio.Event()

        async def run() -> None:
            async with self.shares.running(key):
                self.started.append(name)
                await self.ends[name].wait()

        self.tasks[name] = asyncio.create_task(run())

    async def end(self, name: str) -> None:
        self.ends[name].set()
        await self.tasks[name]

    def use(self, key: ApiKey) -> tuple[int, int]:
        u = self.shares.use[key.name]
        return u.running, len(u.waiting)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def calm_and_flood_running() -> Runner:
    """A gate of 2 places, calm's c0 and flood's f0 running in them."""
    r = Runner(gate(2))
    r.start("c0", CALM)
    r.start("f0", FLOOD)
    await settle()
    return r


async def until(check: Callable[[], bool], what: str, timeout_s: float = 5) -> None:
    """Wait (polling the loop) until ``check()``; fail naming ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, what
        await asyncio.sleep(0.01)


def test_a_key_alone_runs_up_to_the_cap_and_one_past_it_waits():
    async def main() -> None:
        r = Runner(gate(3))
        for i in range(4):
            r.start(f"f{i}", FLOOD)
        await settle()
        assert r.started == ["f0", "f1", "f2"] and r.use(FLOOD) == (3, 1)
        await r.end("f0")
        await settle()
        assert r.started == ["f0", "f1", "f2", "f3"] and r.use(FLOOD) == (3, 0)
        for n in ("f1", "f2", "f3"):
            await r.end(n)
        assert r.shares.running_total == 0 and r.use(FLOOD) == (0, 0)

    asyncio.run(main())


def test_a_freed_place_goes_to_the_key_under_its_share_before_the_floods_older_requests():
    async def main() -> None:
        r = Runner(gate(4))
        for i in range(6):  # alone: all 4 places, 2 wait
            r.start(f"f{i}", FLOOD)
        await settle()
        r.start("c0", CALM)
        r.start("c1", CALM)
        await settle()
        assert r.use(FLOOD) == (4, 2) and r.use(CALM) == (0, 2)  # the cap holds for calm too
        await r.end("f0")
        await settle()
        assert r.started[-1] == "c0"  # before f4, f5 (older): calm runs 0 of its share 2
        await r.end("f1")
        await settle()
        assert r.started[-1] == "c1" and r.use(CALM) == (2, 0)
        await r.end("f2")  # flood runs 1 of its share 2: its oldest goes
        await settle()
        assert r.started[-1] == "f4" and r.use(FLOOD) == (2, 1)
        await r.end("f3")
        await settle()
        assert r.use(FLOOD) == (2, 0)  # at its share: f5 got the place calm does not ask for
        for n in ("c0", "c1", "f4", "f5"):
            await r.end(n)
        assert r.shares.running_total == 0

    asyncio.run(main())


def test_of_the_keys_under_their_share_the_one_running_fewest_goes_first():
    async def main() -> None:
        r = Runner(gate(6))
        for i in range(6):
            r.start(f"f{i}", FLOOD)
        await settle()
        r.start("c0", CALM)
        r.start("c1", CALM)
        r.start("t0", THIRD)  # after calm's two; the shares are 2 each now
        await settle()
        await r.end("f0")
        await settle()
        assert r.started[-1] == "c0"  # both run 0: the oldest
        await r.end("f1")
        await settle()
        assert r.started[-1] == "t0"  # third runs 0, calm 1: third, though c1 is older
        await r.end("f2")
        await settle()
        assert r.started[-1] == "c1"
        for n in ("f3", "f4", "f5", "c0", "c1", "t0"):
            await r.end(n)
        assert r.shares.running_total == 0

    asyncio.run(main())


def test_between_keys_running_as_many_the_older_waiting_request_goes_first():
    async def main() -> None:
        r = Runner(gate(4))  # three keys active: a share of 2 each
        for name, key in (("t0", THIRD), ("t1", THIRD), ("f0", FLOOD), ("c0", CALM)):
            r.start(name, key)
        await settle()
        r.start("c1", CALM)  # waits first
        await settle()
        r.start("f1", FLOOD)  # waits second
        await settle()
        r.start("c2", CALM)  # waits third: calm's newest is younger than flood's
        await settle()
        await r.end("t0")  # a place: flood and calm run 1 each, both under their share
        await settle()
        assert r.started[-1] == "c1" and r.use(FLOOD) == (1, 1)
        for name in ("t1", "f0", "c0", "c1", "f1", "c2"):
            await r.end(name)
            await settle()

    asyncio.run(main())


def test_a_key_between_two_requests_keeps_its_share_for_the_anticipation_time(monkeypatch):
    monkeypatch.setattr(shares_mod, "ANTICIPATE_S", 0.2)

    async def main() -> None:
        r = Runner(gate(2))
        r.start("c0", CALM)
        r.start("f0", FLOOD)
        r.start("f1", FLOOD)
        await settle()
        assert r.use(CALM) == (1, 0) and r.use(FLOOD) == (1, 1)  # one each
        t0 = time.monotonic()
        await r.end("c0")  # calm's client is between two requests now
        await settle()
        assert r.use(FLOOD) == (1, 1)  # the place is calm's a moment longer
        r.start("c1", CALM)  # ... and calm's next request takes it at once
        await settle()
        assert r.started[-1] == "c1" and r.use(FLOOD) == (1, 1)
        await r.end("c1")  # calm does not come back this time
        await until(lambda: r.use(FLOOD) == (2, 0), "flood still waits")
        assert time.monotonic() - t0 >= 0.2  # its share went to flood once it lapsed
        for n in ("f0", "f1"):
            await r.end(n)

    asyncio.run(main())


def test_a_key_running_with_none_waiting_is_active_however_long_ago_it_last_ended():
    """A key whose one request runs (nothing waiting, none ended before) counts among
    the active keys: another key's flood gets its share, not every place left."""

    async def main() -> None:
        r = Runner(gate(4))
        r.start("c0", CALM)
        await settle()
        for i in range(4):
            r.start(f"f{i}", FLOOD)
        await settle()
        assert r.use(CALM) == (1, 0) and r.use(FLOOD) == (2, 2)  # ceil(4 / 2)
        for name in ("c0", "f0", "f1", "f2", "f3"):
            await r.end(name)
            await settle()
        assert r.shares.running_total == 0

    asyncio.run(main())


HEAVY = ApiKey("heavy", "h" * 40, weight=3)


def test_a_heavier_key_gets_its_weights_part_of_the_places_and_one_past_it_waits():
    """heavy (weight 3) and flood (weight 1) at a gate of 4: shares of 3 and 1; freed
    places go to heavy until it runs 3, then to flood until it runs 1; neither goes past."""

    async def main() -> None:
        r = Runner(Shares([FLOOD, HEAVY], None, ServerMetrics(None), 4))
        for i in range(6):  # alone: all 4 places, 2 wait
            r.start(f"f{i}", FLOOD)
        await settle()
        for i in range(4):
            r.start(f"h{i}", HEAVY)
        await settle()
        assert r.use(FLOOD) == (4, 2) and r.use(HEAVY) == (0, 4)
        for i in range(3):  # flood is past its share of 1: each place is heavy's
            await r.end(f"f{i}")
            await settle()
        assert r.started[-3:] == ["h0", "h1", "h2"] and r.use(HEAVY) == (3, 1)
        await r.end("f3")  # heavy at its share of 3 (ceil(4 * 3 / 4)): flood's oldest
        await settle()
        assert r.started[-1] == "f4" and r.use(FLOOD) == (1, 1) and r.use(HEAVY) == (3, 1)
        await r.end("h0")  # heavy under its share again, flood at its share of 1
        await settle()
        assert r.started[-1] == "h3" and r.use(FLOOD) == (1, 1)
        await r.end("h1")  # a place free, but both keys at their share: f5 waits
        await settle()
        assert r.use(FLOOD) == (1, 1) and r.shares.running_total == 3
        for n in ("h2", "h3", "f4", "f5"):
            await r.end(n)
            await settle()
        assert r.shares.running_total == 0

    asyncio.run(main())


def test_equal_running_for_their_weight_the_older_request_goes_first():
    """heavy running 6 (2 for each of its weight 3) and flood running 2 (weight 1) weigh
    the same: the freed place goes to the older waiting request, heavy's, though flood
    runs fewer."""

    async def main() -> None:
        r = Runner(Shares([FLOOD, HEAVY, THIRD], None, ServerMetrics(None), 11))
        for i in range(6):
            r.start(f"h{i}", HEAVY)
        for i in range(2):
            r.start(f"f{i}", FLOOD)
        for i in range(3):  # shares while all three are active: 7, 3, 3 (of 11)
            r.start(f"t{i}", THIRD)
        await settle()
        assert r.shares.running_total == 11
        r.start("h6", HEAVY)  # waits first
        await settle()
        r.start("f2", FLOOD)  # waits second
        await settle()
        await r.end("t0")
        await settle()
        assert r.started[-1] == "h6" and r.use(FLOOD) == (2, 1)
        for n in [f"h{i}" for i in range(7)] + ["f0", "f1", "f2", "t1", "t2"]:
            await r.end(n)
            await settle()
        assert r.shares.running_total == 0

    asyncio.run(main())


def test_every_keys_request_counter_is_there_before_its_first_request():
    """A scrape shows each key's counter from the start (at 0), so a rate over it is
    defined before the key's first request."""
    metrics = ServerMetrics(None)
    Shares([FLOOD, CALM, THIRD], None, metrics, None)
    (family,) = metrics.key_requests.collect()
    totals = {s.labels["key"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert totals == {"flood": 0.0, "calm": 0.0, "third": 0.0}


def test_requests_cancelled_waiting_or_as_their_turn_comes_give_their_place_on():
    async def main() -> None:
        r = Runner(gate(1))
        r.start("f0", FLOOD)
        r.start("f1", FLOOD)
        r.start("f2", FLOOD)
        await settle()
        r.tasks["f1"].cancel()  # waiting: it leaves the queue
        with contextlib.suppress(asyncio.CancelledError):
            await r.tasks["f1"]
        assert r.use(FLOOD) == (1, 1)
        r.ends["f0"].set()
        await asyncio.sleep(0)  # f0 ended (one step of its task): f2's turn came ...
        assert r.use(FLOOD) == (1, 0) and "f2" not in r.started
        r.tasks["f2"].cancel()  # ... and f2 is cancelled before it could run
        with contextlib.suppress(asyncio.CancelledError):
            await r.tasks["f2"]
        await r.tasks["f0"]
        assert "f2" not in r.started
        assert r.shares.running_total == 0 and r.use(FLOOD) == (0, 0)
        r.start("f3", FLOOD)  # the place is free
        await settle()
        assert r.started[-1] == "f3"
        await r.end("f3")

    asyncio.run(main())


def test_a_request_waiting_past_its_timeout_is_a_504_and_leaves_the_queue():
    from omni_serve.errors import APIError

    async def main() -> None:
        shares = gate(1)
        r = Runner(shares)
        r.start("f0", FLOOD)
        await settle()
        t0 = time.monotonic()
        with pytest.raises(APIError) as err:
            async with shares.running(CALM, timeout_s=0.05):
                raise AssertionError("it never ran")
        assert err.value.status == 504 and err.value.code == "timeout"
        assert "--max-running-requests 1" in err.value.message
        assert 0.05 <= time.monotonic() - t0 < 5
        assert r.use(CALM) == (0, 0) and r.use(FLOOD) == (1, 0)
        await r.end("f0")
        assert shares.running_total == 0

    asyncio.run(main())


def test_a_request_held_back_by_an_anticipated_share_runs_once_it_lapses(monkeypatch):
    """Nothing else ends meanwhile: the gate looks again when the share it kept lapses."""
    monkeypatch.setattr(shares_mod, "ANTICIPATE_S", 0.2)

    async def main() -> None:
        r = await calm_and_flood_running()
        await r.end("c0")  # nobody waits: calm's share is kept for 0.2 s
        t0 = time.monotonic()
        r.start("f1", FLOOD)  # flood runs its share (1 of 2 while calm is active)
        await settle()
        assert r.use(FLOOD) == (1, 1)
        # f0 never ends: only the lapse lets f1 in
        await until(lambda: r.use(FLOOD) == (2, 0), "f1 still waits")
        assert time.monotonic() - t0 >= 0.15
        for n in ("f0", "f1"):
            await r.end(n)

    asyncio.run(main())


def test_a_request_waiting_before_another_keys_last_end_runs_once_that_share_lapses(
    monkeypatch,
):
    """f1 waits from before calm's last request ends (its own look-again, on waiting,
    long spent): calm's end, keeping its share a moment, is what makes the gate look
    again once that lapses; f0 never ends."""
    monkeypatch.setattr(shares_mod, "ANTICIPATE_S", 0.1)

    async def main() -> None:
        r = await calm_and_flood_running()
        r.start("f1", FLOOD)  # past flood's share (1 of 2 while calm is active)
        await settle()
        await asyncio.sleep(0.3)  # its own look-again came and went
        assert r.use(FLOOD) == (1, 1)
        await r.end("c0")  # calm's share is kept for 0.1 s, then lapses
        assert r.use(FLOOD) == (1, 1)
        await until(lambda: r.use(FLOOD) == (2, 0), "f1 still waits", timeout_s=2)
        for n in ("f0", "f1"):
            await r.end(n)

    asyncio.run(main())


def test_the_wait_for_a_turn_counts_against_the_requests_timeout():
    """A request that waited about 0.3 s for its turn reaches the pipeline with what is
    left of its 1 s timeout, not all of it (nor nothing)."""
    seen: list[float | None] = []

    class Pipe:
        async def astream(self, request: Any, request_id: Any = None, timeout_s: Any = None):
            seen.append(timeout_s)
            yield "event"

    async def main() -> None:
        shares = gate(1)
        shared = SharedPipeline(Pipe(), shares)
        r = Runner(shares)
        r.start("f0", FLOOD)  # holds the one place
        await settle()
        token = shares_mod.CLIENT.set(CALM)
        try:
            task = asyncio.create_task(_drain(shared.astream({}, "x", 1.0)))
        finally:
            shares_mod.CLIENT.reset(token)
        await asyncio.sleep(0.3)
        await r.end("f0")
        assert await task == ["event"]

    asyncio.run(main())
    (left,) = seen
    assert left is not None and 0.05 < left <= 0.71, left


async def _drain(stream: Any) -> list[Any]:
    return [ev async for ev in stream]


def test_an_address_counts_to_its_last_connection_and_is_forgotten_after_it():
    """Two connections of an address at its cap of 2: one past is refused; one closing
    leaves the other counted (one more may open, not two); the last closing leaves no
    entry behind."""
    shares = Shares([FLOOD], 2, ServerMetrics(None))
    a, b = shares.connect("10.0.0.1"), shares.connect("10.0.0.1")
    assert a is not None and b is not None and shares.connect("10.0.0.1") is None
    shares.disconnect(a)
    c = shares.connect("10.0.0.1")
    assert c is not None and shares.connect("10.0.0.1") is None
    shares.disconnect(b)
    shares.disconnect(c)
    assert "10.0.0.1" not in shares.unkeyed


def test_a_scope_other_than_http_passes_the_shares_untouched():
    """The lifespan (and a websocket) scope goes to the app as it came, keys or not."""
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    middleware = ClientShares(app, Shares([FLOOD], None, ServerMetrics(None)))
    for kind in ("lifespan", "websocket"):
        asyncio.run(middleware({"type": kind}, None, None))  # type: ignore[arg-type]
    assert seen == ["lifespan", "websocket"]


def test_the_flag_needs_a_keys_file_and_a_positive_number():
    from omni_serve.settings import ServeSettings, SettingsError

    with pytest.raises(SettingsError, match="--api-keys-file"):
        ServeSettings(model_name="m", max_running_requests=2)
    with pytest.raises(SettingsError, match="max_running_requests"):
        ServeSettings(model_name="m", api_keys=(FLOOD,), max_running_requests=0)
    ServeSettings(model_name="m", api_keys=(FLOOD,), max_running_requests=1)


# ---------------------------------------------------------------------- a real server
HOLD_S = 0.5
KEYS = {"flood": "flood-" + "k" * 40, "calm": "calm-" + "k" * 40}
KEYS_FILE = "".join(f'[[keys]]\nname = "{n}"\nkey = "{k}"\n\n' for n, k in KEYS.items())


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    """The server, and the gate file its stage holds every request on until it exists."""
    where = tmp_path_factory.mktemp("fair-running")
    keys = where / "keys.toml"
    keys.write_text(KEYS_FILE)
    keys.chmod(0o600)
    gate = where / "gate"
    stage = slow(HOLD_S)
    stage["options"]["until_file"] = str(gate)
    s = start_server(
        intake_then("running", tiny_llama, stage),
        where,
        *("--api-keys-file", str(keys), "--max-running-requests", "2"),
    )
    yield s, gate
    gate.touch()
    stop_server(s)


def test_a_keys_request_passes_the_floods_older_ones_and_the_gauges_say_so(server):
    """The stage holds every request until the test opens its gate, so calm's request
    waits however long posting it takes on a busy machine."""
    server, gate = server
    url = f"{server.url}/v1/completions"
    auth = {n: {"Authorization": f"Bearer {k}"} for n, k in KEYS.items()}
    done: list[str] = []
    body: dict[str, Any] = {"prompt": "hello", "max_tokens": 1}

    def scrape(name: str, key: str) -> float:
        text = httpx.get(f"{server.url}/metrics", headers=auth["calm"], timeout=10).text
        return sample(text, name, key=key)

    threads: list[threading.Thread] = []
    statuses: dict[str, int] = {}

    def post(tag: str, key: str) -> None:
        def record() -> None:
            r = httpx.post(url, json=body, headers=auth[key], timeout=60)
            statuses[tag] = r.status_code
            done.append(tag)

        threads.append(threading.Thread(target=record))
        threads[-1].start()

    for i in range(4):
        post(f"f{i}", "flood")
    wait_for(lambda: scrape("omni_http_key_waiting", "flood") == 2, "flood: 2 running, 2 waiting")
    assert scrape("omni_http_key_running", "flood") == 2
    post("c0", "calm")
    wait_for(lambda: scrape("omni_http_key_waiting", "calm") == 1, "calm waits at the cap")
    assert scrape("omni_http_key_waiting", "flood") == 2
    gate.touch()  # the stage goes on: each place freed from now on is given to a waiter
    for t in threads:
        t.join(60)
    assert statuses == dict.fromkeys(("f0", "f1", "f2", "f3", "c0"), 200), statuses
    # the stage holds one request at a time: two of flood's ran first; the first place
    # freed went to calm (0 running, share 1), not to flood's other two, which came before
    # it (first come, first served would have made calm fourth)
    assert done.index("c0") == 2, done
    assert scrape("omni_http_key_running", "flood") == scrape("omni_http_key_waiting", "calm") == 0
