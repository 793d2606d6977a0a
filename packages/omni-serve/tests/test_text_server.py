"""Text endpoints of ``omni serve`` over the tiny-Llama AR pipeline, driven by the real
``openai`` client; bad requests; client disconnect cancels; metrics and logs."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("transformers")


def scrape(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus-client's own parser."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_models_lists_the_pipeline(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny_chat"]


def test_chat_completion_and_its_stream_give_the_same_text(client):
    messages = [{"role": "user", "content": "the quick brown fox"}]
    full = client.chat.completions.create(
        model="tiny_chat", messages=messages, max_tokens=12, temperature=0
    )
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens > 4  # the chat template's tokens and the prompt's
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert choice.finish_reason in ("length", "stop")
    stream = client.chat.completions.create(
        model="tiny_chat",
        messages=messages,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([d for d in deltas if d]) > 1  # it streamed, not one lump
    assert "".join(deltas) == choice.message.content  # greedy: the same text
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason


def test_completion_and_stop(client):
    out = client.completions.create(
        model="tiny_chat", prompt="a red fox", max_tokens=8, extra_body={"ignore_eos": True}
    )
    text = out.choices[0].text
    assert text and out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    stop = text[len(text) // 2 :][:2]
    cut = client.completions.create(model="tiny_chat", prompt="a red fox", max_tokens=8, stop=stop)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 17}, "n"),  # past --max-n
        ({"messages": [{"role": "user", "content": "x"}], "best_of": 2}, "best_of"),
        ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, "model"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]},
            "tools[0].type",
        ),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_field(text_server, body, param):
    r = httpx.post(f"{text_server.url}/v1/chat/completions", json=body, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param.split("[")[0] in err["message"]
    assert "Traceback" not in r.text


def test_malformed_bodies_and_wrong_endpoints(text_server):
    url = text_server.url
    json_body = {"content-type": "application/json"}
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers=json_body)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{}")  # says not what it is
    assert r.status_code == 415 and r.json()["error"]["param"] == "Content-Type"
    big = b"x" * ((20 << 20) + 1)  # over the default --max-body-bytes (20 MiB)
    r = httpx.post(f"{url}/v1/chat/completions", content=big, headers=json_body, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert f"limit of {20 << 20} bytes (--max-body-bytes)" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/images/generations", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 404 and "/v1/chat/completions" in r.json()["error"]["message"]
    r = httpx.get(f"{url}/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()


def test_a_bad_field_the_pipeline_finds_is_a_400_in_a_stream_too(client):
    # the prompt's length is checked by the intake stage (max_prompt_tokens: 64), after
    # the server accepted the request: still a 400 naming the field, before any chunk
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny_chat", prompt="fox " * 200, stream=True)
    assert e.value.body["param"] == "prompt"
    assert "max_prompt_tokens" in e.value.body["message"]
    assert client.completions.create(model="tiny_chat", prompt="ok", max_tokens=2).choices


def test_client_disconnect_cancels_the_request(text_server, client):
    before = scrape(text_server).get(("omni_requests_total", (("outcome", "cancelled"),)), 0)
    body = {
        "messages": [{"role": "user", "content": "a red fox"}],
        "max_tokens": 256,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{text_server.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk: the request runs; now hang up
    end = time.monotonic() + 10
    while time.monotonic() < end:
        samples = scrape(text_server)
        cancelled = samples.get(("omni_requests_total", (("outcome", "cancelled"),)), 0)
        if cancelled > before and samples[("omni_requests_in_flight", ())] == 0:
            break
        time.sleep(0.1)
    assert cancelled == before + 1
    assert samples[("omni_http_client_disconnects_total", ())] >= 1
    # and the server goes on serving
    assert client.completions.create(model="tiny_chat", prompt="ok", max_tokens=2).choices


def test_non_streaming_disconnect_cancels_too(text_server):
    before = scrape(text_server).get(("omni_requests_total", (("outcome", "cancelled"),)), 0)
    body = {"prompt": "a red fox", "max_tokens": 256, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{text_server.url}/v1/completions", json=body, timeout=0.2)
    end = time.monotonic() + 10
    cancelled = before
    while time.monotonic() < end and cancelled == before:
        time.sleep(0.1)
        cancelled = scrape(text_server).get(("omni_requests_total", (("outcome", "cancelled"),)), 0)
    assert cancelled == before + 1


def test_per_request_timeout(client):
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(
            model="tiny_chat",
            prompt="a red fox",
            max_tokens=256,
            extra_body={"timeout_s": 0.05, "ignore_eos": True},
        )
    assert e.value.status_code == 504 and e.value.body["code"] == "timeout"


def test_metrics_scrape_parses_and_covers_stages_and_requests(text_server, client):
    client.completions.create(model="tiny_chat", prompt="a red fox", max_tokens=4)
    postprocess = ("omni_stage_received_total", (("stage", "postprocess"),))
    for _ in range(50):  # stage counters come with the workers' heartbeats
        samples = scrape(text_server)
        if samples.get(postprocess, 0) > 0:
            break
        time.sleep(0.1)
    names = {name for name, _ in samples}
    for stage in ("intake", "prefill", "decode", "postprocess"):
        label = (("stage", stage),)
        assert samples[("omni_stage_up", label)] == 1
        assert samples[("omni_stage_received_total", label)] > 0
        assert ("omni_stage_queue_depth", label) in samples
        assert ("omni_stage_blocked_seconds_total", label) in samples
        assert ("omni_stage_restarts_total", label) in samples
        # on a CPU: the GPU families are there, the memory at 0, no utilisation sample
        assert samples[("omni_stage_gpu_mem_allocated_bytes", label)] == 0
        assert ("omni_stage_gpu_utilization_percent", label) not in samples
    for name in (
        "omni_stage_window_triggers_total",
        "omni_stage_dropped_total",
        "omni_stage_enqueue_per_s",
        "omni_request_time_to_first_event_seconds",
        "omni_request_time_between_events_seconds",
        "omni_request_latency_seconds_count",
        "omni_http_requests_total",
        "omni_http_request_duration_seconds_bucket",
    ):
        assert name in names, name
    assert samples[("omni_requests_total", (("outcome", "completed"),))] >= 1
    assert samples[("omni_request_latency_seconds_count", ())] >= 1


def test_logs_carry_request_id(text_server, client):
    r = client.completions.with_raw_response.create(model="tiny_chat", prompt="x", max_tokens=2)
    rid = r.headers["x-request-id"]
    time.sleep(0.2)
    lines = [line for line in text_server.log().splitlines() if f"request_id={rid}" in line]
    assert any("request completed" in line for line in lines), text_server.log()[-2000:]
