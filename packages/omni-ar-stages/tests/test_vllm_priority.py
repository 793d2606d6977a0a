"""The vLLM engine under ``scheduler_policy: priority`` (in-process, CPU): the requests
waiting inside vLLM start by (priority, arrival), and when the KV cache runs out vLLM
preempts the running request of the lowest priority, which still completes with the
tokens it gives alone (greedy). Under ``fcfs``: arrival order, and the latest arrival is
the one preempted. Engine steps and preemptions are observed by wrapping vLLM's own
calls (each wrapper calls the real one)."""

import pytest
from omni_ar.engines.vllm_engine import VllmEngine
from omni_ar.params import SamplingParams

pytestmark = pytest.mark.usefixtures("restore_environment")  # in-process engines

# two requests run at once; 6 blocks of 32 tokens (one is vLLM's null block): 160 tokens
ENGINE_ARGS = {
    "block_size": 32,
    "max_model_len": 160,
    "num_gpu_blocks_override": 6,
    "max_num_seqs": 2,
}


def prompt(n, salt):
    return [3 + (i * 7 + salt) % 300 for i in range(n)]


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


class Observed:
    """What the engine's vLLM did: each request added (its id, its priority), the
    requests that got tokens at each step, the requests preempted."""

    def __init__(self, engine, monkeypatch):
        self.added: list[tuple[str, int]] = []
        self.steps: list[list[str]] = []
        self.preempted: list[str] = []
        llm = engine.engine
        add, step = llm.add_request, llm.step
        scheduler = llm.engine_core.engine_core.scheduler
        preempt = scheduler._preempt_request

        def add_request(rid, prompt, params, **kw):
            self.added.append((rid, kw.get("priority", 0)))
            return add(rid, prompt, params, **kw)

        def step_():
            outs = step()
            self.steps.append([o.request_id for o in outs if o.outputs[0].token_ids])
            return outs

        def preempt_request(request, *a, **kw):
            self.preempted.append(request.request_id)
            return preempt(request, *a, **kw)

        monkeypatch.setattr(llm, "add_request", add_request)
        monkeypatch.setattr(llm, "step", step_)
        monkeypatch.setattr(scheduler, "_preempt_request", preempt_request)

    def rid(self, i):
        return self.added[i][0]

    def first_step(self, rid):
        return next(n for n, rids in enumerate(self.steps) if rid in rids)

    def last_step(self, rid):
        return max(n for n, rids in enumerate(self.steps) if rid in rids)


def drain(streams):
    """Round-robin over ``streams`` (name -> iterator), as a decode worker drives its
    generators: name -> its tokens, and the names in the order they ended."""
    tokens = {name: [] for name in streams}
    ended = []
    live = dict(streams)
    while live:
        for name, s in list(live.items()):
            try:
                tokens[name].append(next(s)[0])
            except StopIteration:
                ended.append(name)
                del live[name]
    return tokens, ended


@pytest.fixture(scope="module", params=["priority", "fcfs"])
def engine(request, vllm_model):
    e = VllmEngine(vllm_model, engine_args=ENGINE_ARGS, scheduling_policy=request.param)
    e.load_model()
    return e


def test_waiting_requests_start_by_priority_then_arrival(engine, monkeypatch):
    seen = Observed(engine, monkeypatch)
    priorities = {"a": 3, "b": 0, "c": 3, "d": -1, "e": 0}
    # the blocker holds one of the two seats for longer than the others take together;
    # the others wait in vLLM for the second seat, entering it one at a time
    blocker = engine.stream(prompt(8, 0), greedy(100), priority=5)
    first = [next(blocker)[0] for _ in range(3)]
    streams = {
        n: engine.stream(prompt(6, i + 1), greedy(6), p)
        for i, (n, p) in enumerate(priorities.items())
    }
    tokens, _ = drain({"blocker": blocker, **streams})
    names = list(priorities)
    policy = engine.scheduling_policy
    # vLLM got the request's priority under priority, 0 under fcfs
    sent = [p for _, p in seen.added]
    assert sent == ([5, *priorities.values()] if policy == "priority" else [0] * 6)
    started = {n: seen.first_step(seen.rid(i + 1)) for i, n in enumerate(names)}
    assert len(set(started.values())) == len(names)  # one start per step: an order
    order = sorted(names, key=started.get)
    if policy == "priority":
        assert order == sorted(names, key=lambda n: (priorities[n], names.index(n)))
    else:
        assert order == names
    # the blocker ran throughout (no preemption) and gives the tokens it gives alone
    assert not seen.preempted
    assert max(started.values()) < seen.last_step(seen.rid(0))
    assert [*first, *tokens["blocker"]] == [t for t, _ in engine.stream(prompt(8, 0), greedy(100))]
    for i, n in enumerate(names):
        assert tokens[n] == [t for t, _ in engine.stream(prompt(6, i + 1), greedy(6))]


def test_a_full_kv_cache_preempts_the_lowest_priority_which_completes_unchanged(
    engine, monkeypatch
):
    """``low`` runs; ``high`` (priority 0) arrives and both decode until the 5 blocks are
    full (``low`` grows to 5, ``high`` to 4 blocks, at most): vLLM preempts ``low`` under
    priority (``high`` then finishes first), ``high`` (the latest arrival) under fcfs;
    the preempted one resumes by recomputing and gives the tokens it gives alone."""
    long, short = (prompt(40, 0), greedy(110)), (prompt(40, 1), greedy(60))
    alone = {n: [t for t, _ in engine.stream(*r)] for n, r in (("low", long), ("high", short))}
    seen = Observed(engine, monkeypatch)
    low = engine.stream(*long, priority=5)
    first = [next(low)[0] for _ in range(10)]
    high = engine.stream(*short, priority=0)
    tokens, ended = drain({"low": low, "high": high})
    tokens["low"][:0] = first
    assert tokens == alone
    victim = "low" if engine.scheduling_policy == "priority" else "high"
    rid = seen.rid(0 if victim == "low" else 1)
    assert seen.preempted and all(r.startswith(rid) for r in seen.preempted), seen.preempted
    if engine.scheduling_policy == "priority":
        assert ended == ["high", "low"]
