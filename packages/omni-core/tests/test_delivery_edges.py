"""A request's inbox at its edges, as its reader sees it: how many events wait before a
lagging reader's start to merge (the default, at it and one past), what merges with what,
a waiting preview anywhere in the inbox replaced, an async reader woken from another
thread, and a reader whose event loop closed. No process."""

import asyncio

from omni_core.client.collector import Collector
from omni_core.client.delivery import DONE, Inbox
from omni_core.dataplane.serial import ArrayCodec
from omni_core.events import Completed, ImageProgress, Segment


def seg(n: int, stage: str = "s", **kw) -> Segment:
    return Segment(request_id="r", sequence=n, stage=stage, tokens=[n], **kw)


def preview(step: int, stage: str = "vae") -> ImageProgress:
    return ImageProgress(request_id="r", stage=stage, step=step)


def drained(inbox: Inbox) -> list:
    inbox.put(DONE)
    return list(inbox)


# -- when a lagging reader's events start to merge ----------------------------------------


def test_64_events_wait_as_they_came_and_the_65th_merges():
    c = Collector(["s"], [], ArrayCodec("client"))
    h = c.open("r")
    for n in range(64):  # up to the limit: each waits as its own event
        c.on_event(seg(n))
    assert h.waiting == 64 and h.sequence == 64
    c.on_event(seg(64))  # one past: merged into the newest waiting one
    assert h.waiting == 64 and h.sequence == 64
    c.on_event(Completed(request_id="r", stage="s", sequence=65))
    *segments, end = list(h)
    assert end.event_type == "completed" and len(segments) == 64
    assert [e.tokens for e in segments[:63]] == [[n] for n in range(63)]
    assert segments[63].tokens == [63, 64]
    assert [e.sequence for e in (*segments, end)] == list(range(65))


def test_the_inbox_counts_each_event_it_merged_away():
    inbox = Inbox(None, coalesce_after=2)
    inbox.put(seg(0))
    inbox.put(seg(1))
    assert inbox.merged == 0  # at the limit: nothing merged yet
    inbox.put(seg(2))  # a segment folded into the one before it
    assert inbox.merged == 1
    inbox.put(preview(1))  # no preview of its stage waits: it waits itself
    assert inbox.merged == 1
    inbox.put(preview(2))  # replaces the waiting preview
    assert inbox.merged == 2 and len(inbox) == 3


# -- what merges with what ----------------------------------------------------------------


def test_payload_values_merge_only_text_with_text_and_lists_with_lists():
    inbox = Inbox(None, coalesce_after=1)
    inbox.put(seg(0, payload={"text": "Hel", "ids": [1], "kind": "a", "boxes": [7], "x": 1}))
    inbox.put(seg(1, payload={"text": "lo", "ids": [2], "kind": [3], "boxes": "b", "y": "t"}))
    inbox.put(seg(2, payload={"text": "!", "ids": None, "z": [4], "x": "now text"}))
    (merged,) = drained(inbox)
    assert merged.tokens == [0, 1, 2]
    assert merged.payload == {
        "text": "Hello!",  # text after text: appended
        "ids": None,  # a list then none: the newer value
        "kind": [3],  # text then a list: the newer value
        "boxes": "b",  # a list then text: the newer value
        "x": "now text",  # a number then text
        "y": "t",  # new keys, text and list: as they came
        "z": [4],
    }


def test_segments_merge_only_within_one_stage():
    inbox = Inbox(None, coalesce_after=1)
    for stage, n in (("a", 0), ("b", 0), ("b", 1), ("a", 1)):
        inbox.put(seg(n, stage=stage))
    events = drained(inbox)
    assert [(e.stage, e.tokens) for e in events] == [("a", [0]), ("b", [0, 1]), ("a", [1])]
    assert [e.sequence for e in events] == [0, 1, 2]


def test_a_new_preview_replaces_a_waiting_one_at_the_front_of_the_inbox():
    """The scan for a preview of the same stage goes back to the oldest waiting event."""
    inbox = Inbox(None, coalesce_after=4)
    inbox.put(preview(1))  # index 0
    for n in range(3):  # another stage's segments after it, each its own event
        inbox.put(seg(n, stage="text", is_last=True))
    inbox.put(preview(2))
    events = drained(inbox)
    assert [(type(e).__name__, e.stage) for e in events] == [
        ("ImageProgress", "vae"),
        ("Segment", "text"),
        ("Segment", "text"),
        ("Segment", "text"),
    ]
    assert events[0].step == 2 and [e.sequence for e in events] == [0, 1, 2, 3]


# -- an async reader ----------------------------------------------------------------------


def test_an_async_reader_that_awaits_is_woken_by_each_event_put_from_another_thread():
    async def main() -> tuple[list, list]:
        inbox = Inbox(asyncio.get_running_loop())
        arrived: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            async for ev in inbox:
                arrived.put_nowait(ev)

        reader = asyncio.create_task(read())
        await asyncio.sleep(0)  # the reader runs first: it awaits an empty inbox
        got, accepted = [], []
        for n in range(3):
            accepted.append(await asyncio.to_thread(inbox.put, seg(n)))
            got.append(await arrived.get())  # then it awaits again, before the next put
        accepted.append(await asyncio.to_thread(inbox.put, DONE))
        await reader  # the end ends its loop
        return got, accepted

    got, accepted = asyncio.run(asyncio.wait_for(main(), 5))
    assert [e.tokens for e in got] == [[0], [1], [2]] and [e.sequence for e in got] == [0, 1, 2]
    assert accepted == [True] * 4


def test_an_inbox_whose_event_loop_closed_refuses_events():
    """``asyncio.run`` returns while the reader awaits: it cancels the reader, closes the
    loop, and whatever comes next finds nobody to read it."""

    async def caller(start_reading: bool) -> Inbox:
        inbox = Inbox(asyncio.get_running_loop())
        if start_reading:
            asyncio.create_task(anext(aiter(inbox)))
            await asyncio.sleep(0)  # the reader awaits the first event
        return inbox

    never_read = asyncio.run(caller(start_reading=False))
    assert never_read.put(seg(0)) is False
    awaited = asyncio.run(caller(start_reading=True))
    assert awaited.put(seg(0)) is False  # it cannot be woken
    assert awaited.put(DONE) is False
