"""Checks that only a fault sets off, set off through a real pipeline.

The collector's sequence check on a streaming stage: a worker never skips a sequence
number, so the loss is made on the last stretch of the real path. The stages run in their
worker processes and their events reach the orchestrator as real frames, decoded as
always; one event is then lost on its way into the collector, as a lost frame would be.
"""

from omni_core import Pipeline
from omni_core.client.collector import Collector
from omni_core.events import Completed, Error, Segment
from omni_testing.configs import chain

FAST = {"heartbeat_interval_s": 0.05}


def test_a_lost_event_of_a_streaming_stage_fails_its_request_with_sequence_gap(
    monkeypatch, no_leaked_segments
):
    cfg = chain(
        ("src", "synthetic.source", {"segment": 1}, {"client_stream": True}),
        ("map", "synthetic.map", {"scale": 10}),
        edges=[{"from": "src", "to": "map", "window": {"size": 1}}],
        **FAST,
    )
    real = Collector.on_event
    lost: list[Segment] = []

    def on_event(self, ev):
        if ev.request_id == "gap" and ev.stage == "src" and ev.sequence == 1 and not lost:
            lost.append(ev)  # this event never reaches the collector
            return [], False
        return real(self, ev)

    monkeypatch.setattr(Collector, "on_event", on_event)
    with Pipeline(cfg) as pipe:
        assert pipe.backend.collector.streaming == {"src", "map"}
        gap = pipe.submit({"n": 5}, request_id="gap")
        other = pipe.submit({"n": 5}, request_id="other")
        gap_events = list(gap)
        other_events = list(other)
        after = pipe.generate([{"n": 3}])[0]  # the pipeline goes on
    assert len(lost) == 1 and type(lost[0]) is Segment and lost[0].tokens == [1]
    end = gap_events[-1]
    assert isinstance(end, Error), end
    assert end.code == "sequence_gap" and end.stage == "src"
    assert "event sequence 2 where 1 was expected (lost event)" in end.message
    assert gap.finish_reason == "error"
    # what came before the gap was delivered, nothing of src after it
    src_tokens = [t for e in gap_events[:-1] if e.stage == "src" for t in e.tokens]
    assert src_tokens == [0]
    # the other request, in flight at the same time, is whole
    assert isinstance(other_events[-1], Completed)
    segments = [e for e in other_events if type(e) is Segment]
    assert [t for e in segments if e.stage == "src" for t in e.tokens] == list(range(5))
    assert [t for e in segments if e.stage == "map" for t in e.tokens] == [10 * t for t in range(5)]
    assert after.ok, after.error
