"""A slow client holds a bounded number of events on the server: the merged stream takes
only a few events ahead of it, the rest coalesce in each request's inbox."""

import asyncio

from omni_core import Pipeline
from omni_serve.sse import MERGE_WINDOW, merged
from omni_testing.configs import chain


def test_a_slow_reader_of_a_merged_stream_gets_coalesced_events():
    cfg = chain(("src", "synthetic.source", {"segment": 1}), heartbeat_interval_s=0.05)

    async def read_slowly(pipe):
        events = []
        stream = merged(pipe, [{"n": 3000}, {"n": 3000}], ["a", "b"], None)
        async for i, ev in stream:
            if not events:  # the client stalls: everything else is produced meanwhile
                while pipe.metrics()["in_flight"]:
                    await asyncio.sleep(0.05)
            events.append((i, ev))
        return events

    with Pipeline(cfg) as pipe:
        events = asyncio.run(read_slowly(pipe))
    for k in (0, 1):
        mine = [ev for i, ev in events if i == k]
        tokens = [t for ev in mine if ev.event_type == "segment" for t in ev.tokens]
        assert tokens == list(range(3000))  # all of it, in order
        # a few taken ahead, the coalescing inbox's backlog, then what came after
        assert len(mine) < 4 * MERGE_WINDOW + 100
