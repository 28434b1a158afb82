"""vLLM's gauge names on /metrics, scraped from a live server while a request streams and
parsed with prometheus_client's text parser: the names, labels and 0..1 fraction that the
Gateway API Inference Extension's endpoint picker and autoscalers read."""

from __future__ import annotations

import httpx
import openai

from deepinfer.api.app import create_app
from tests.api.fake_engine import FakeEngine
from tests.api.live_server import LiveServer
from tests.api.ops.test_ops import samples

LABELS = (("engine", "0"), ("model_name", "fake-model"))


def test_vllm_gauges_mirror_ours_while_a_request_runs() -> None:
    engine = FakeEngine(num_blocks=64, block_size=4, step_s=0.05)
    server = LiveServer(create_app(engine)).start()
    try:
        idle = samples(httpx.get(server.url + "/metrics").text)
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
            stream = c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q" * 40}], max_tokens=50,
                stream=True,
            )  # fmt: skip
            for chunk in stream:  # the first token: the engine has stepped (the role chunk may
                if chunk.choices and chunk.choices[0].delta.content:  # come before any step)
                    break
            busy = samples(httpx.get(server.url + "/metrics").text)
            stream.close()
    finally:
        server.stop()
    assert idle[("vllm:num_requests_running", LABELS)] == 0
    assert idle[("vllm:kv_cache_usage_perc", LABELS)] == 0
    assert busy[("vllm:num_requests_running", LABELS)] == 1
    assert busy[("vllm:num_requests_waiting", LABELS)] == 0
    used = busy[("deepinfer_kv_blocks_used", ())]
    total = busy[("deepinfer_kv_blocks_total", ())]
    assert used > 0
    assert busy[("vllm:kv_cache_usage_perc", LABELS)] == used / total
    assert busy[("vllm:gpu_cache_usage_perc", LABELS)] == used / total
    assert ("deepinfer_kv_events_dropped_total", ()) not in busy  # events off
