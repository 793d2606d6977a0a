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


def alone(engine, ids, params):
    """The request's tokens, run alone."""
    return [s[0] for s in engine.stream(ids, params) if s is not None]


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
    generators (a None: that request waits in vLLM): name -> its tokens, and the names
    in the order they ended."""
    tokens = {name: [] for name in streams}
    ended = []
    live = dict(streams)
    while live:
        for name, s in list(live.items()):
            try:
                if (step := next(s)) is not None:
                    tokens[name].append(step[0])
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
    first = [next(blocker)[0] for _ in range(3)]  # it runs: no None
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
    assert [*first, *tokens["blocker"]] == alone(engine, prompt(8, 0), greedy(100))
    for i, n in enumerate(names):
        assert tokens[n] == alone(engine, prompt(6, i + 1), greedy(6))


def test_a_full_kv_cache_preempts_the_lowest_priority_which_completes_unchanged(
    engine, monkeypatch
):
    """``low`` runs; ``high`` (priority 0) arrives and both decode until the 5 blocks are
    full (``low`` grows to 5, ``high`` to 4 blocks, at most): vLLM preempts ``low`` under
    priority (``high`` then finishes first), ``high`` (the latest arrival) under fcfs;
    the preempted one resumes by recomputing and gives the tokens it gives alone."""
    long, short = (prompt(40, 0), greedy(110)), (prompt(40, 1), greedy(60))
    by_itself = {n: alone(engine, *r) for n, r in (("low", long), ("high", short))}
    seen = Observed(engine, monkeypatch)
    low = engine.stream(*long, priority=5)
    first = [next(low)[0] for _ in range(10)]  # it runs: no None
    high = engine.stream(*short, priority=0)
    tokens, ended = drain({"low": low, "high": high})
    tokens["low"][:0] = first
    assert tokens == by_itself
    victim = "low" if engine.scheduling_policy == "priority" else "high"
    rid = seen.rid(0 if victim == "low" else 1)
    assert seen.preempted and all(r.startswith(rid) for r in seen.preempted), seen.preempted
    if engine.scheduling_policy == "priority":
        assert ended == ["high", "low"]


@pytest.fixture(scope="module")
def long_model(vllm_model, tmp_path_factory):
    """The tiny Llama for vLLM taking 4096 positions: a request that lasts seconds
    (skipped as ``vllm_model`` is)."""
    from omni_ar.testing import build_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama-32-long")
    return str(build_tiny_llama(path, head_dim=32, max_positions=4096))


def test_the_generate_stage_passes_each_request_priority_to_vllm(long_model):
    """``ar.generate`` on vLLM, taking up to 8 requests into an engine that runs one at a
    time, under priority: while a blocker runs, each request enters the engine as it
    arrives (the next is submitted once the stage holds the last), so only vLLM can
    reorder them; once the blocker is cancelled they end (at the stage) by priority,
    then arrival, each with its tokens alone."""
    from omni_core import Pipeline
    from omni_core.client.collector import collect
    from omni_testing.configs import chain
    from omni_testing.faults import wait_for

    opts = {"model": long_model, "engine": "vllm"}
    engine_args = {"block_size": 32, "max_model_len": 4096, "max_num_seqs": 1}
    generate = {**opts, "max_segment_tokens": 4, "engine_args": engine_args}
    cfg = chain(
        ("intake", "ar.intake", opts),
        # its events, stamped when made, reach the caller
        ("generate", "ar.generate", generate, {"max_inflight": 8, "client_stream": True}),
        mrs={"defaults": {"scheduler_policy": "priority"}},
        ready_timeout_s=300,
        heartbeat_interval_s=0.05,
    )
    priorities = {"a": 2, "b": 0, "c": 2, "d": -1}
    words = ["a red fox", "the lazy dog", "héllo wörld", "omni pipelines"]
    requests = {
        n: {"prompt": w, "max_tokens": 8, "ignore_eos": True, "priority": priorities[n]}
        for n, w in zip(priorities, words, strict=True)
    }
    blocker = {"prompt": "the quick brown fox", "max_tokens": 4000, "ignore_eos": True}
    with Pipeline(cfg) as pipe:

        def held(k):
            def inflight():
                return pipe.metrics()["stages"]["generate"]["inflight"]

            wait_for(lambda: inflight() == k, 60, f"{k} requests in the engine")

        handles = {"blocker": pipe.submit(blocker)}
        for n, r in requests.items():
            held(len(handles))
            handles[n] = pipe.submit(r)
        held(len(handles))
        assert pipe.cancel(handles.pop("blocker").request_id)
        outs = {n: collect(h) for n, h in handles.items()}
        alone = {n: pipe.generate([r])[0] for n, r in requests.items()}

    def tokens(out):
        assert out.ok, out.error
        return [t for e in out.by_stage("generate") for t in e.tokens]

    assert {n: tokens(o) for n, o in outs.items()} == {n: tokens(o) for n, o in alone.items()}
    ended = sorted(outs, key=lambda n: outs[n].by_stage("generate")[-1].ts)
    names = list(requests)
    assert ended == sorted(names, key=lambda n: (priorities[n], names.index(n)))
