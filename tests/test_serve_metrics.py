"""``npuw-kv serve``'s vLLM-style observability: ``/metrics`` read by ``prometheus_client``'s own
parser, each counter moving as the requests say; ``/tokenize``, ``/detokenize``, ``/version``;
``stream_options.continuous_usage_stats``; and guidellm, at its defaults, against it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from npuw_kv.serve.child import ServeProcess

MODEL = "smollm2"
NAMES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:num_preemptions": "counter",
}


@pytest.fixture(scope="module")
def server():
    proc = ServeProcess("--max-prompt-len", "256", "--min-response-len", "48",
                        "-p", "max_num_seqs=2")  # fmt: skip
    yield proc
    assert proc.stop() == 0, proc.stderr()
    assert "Traceback" not in proc.stderr()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def scrape(server: ServeProcess) -> dict[str, float]:
    """Every sample of ``/metrics`` by name (labelled ``model_name``, checked), and each
    family's type by name under ``"type:<family>"``."""
    reply = httpx.get(server.root + "/metrics", timeout=30)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(reply.text):
        out["type:" + family.name] = family.type  # type: ignore[assignment]
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL
            key = sample.name
            if "finished_reason" in sample.labels:
                key += ":" + sample.labels["finished_reason"]
            if "le" not in sample.labels:
                out[key] = sample.value
    return out


def moved(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_metrics_have_vllms_names_and_move_as_the_requests_say(server, client):
    first = scrape(server)
    for name, kind in NAMES.items():
        assert first["type:" + name] == kind, name
    question = [{"role": "user", "content": "Name three fruits, with a word on each."}]
    answer = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=6, extra_body={"ignore_eos": True}
    )
    second = scrape(server)
    usage = answer.usage
    assert usage.completion_tokens == 6
    assert moved(first, second, "vllm:prompt_tokens_total") == usage.prompt_tokens
    assert moved(first, second, "vllm:generation_tokens_total") == 6
    assert moved(first, second, "vllm:request_success_total:length") == 1
    assert moved(first, second, "vllm:time_to_first_token_seconds_count") == 1
    assert moved(first, second, "vllm:e2e_request_latency_seconds_count") == 1
    assert moved(first, second, "vllm:inter_token_latency_seconds_count") == 5  # 6 tokens
    assert moved(first, second, "vllm:e2e_request_latency_seconds_sum") >= moved(
        first, second, "vllm:time_to_first_token_seconds_sum"
    )
    assert moved(first, second, "vllm:prefix_cache_queries_total") >= usage.prompt_tokens
    assert second["vllm:num_requests_running"] == 0 == second["vllm:num_requests_waiting"]
    assert second["vllm:num_preemptions_total"] == 0  # the pool holds both sequences
    # the same prompt again: its full blocks come from the prefix cache
    client.chat.completions.create(model=MODEL, messages=question, max_tokens=2)
    third = scrape(server)
    hits = moved(second, third, "vllm:prefix_cache_hits_total")
    assert 0 < hits <= moved(second, third, "vllm:prefix_cache_queries_total")


def test_running_waiting_and_kv_use_while_requests_run(server, client):
    """Two long streams take both sequences; a third request waits for a turn."""
    started = threading.Barrier(3)
    done: list[str] = []

    def stream(i: int) -> None:
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to {100 + i}."}],
            max_tokens=120, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        started.wait()  # its first token came: it runs
        done.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))

    def wait() -> None:
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        done.append(answer.choices[0].message.content or "")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait()
    running = scrape(server)
    threads.append(threading.Thread(target=wait))
    threads[-1].start()
    seen_waiting = False
    for _ in range(600):  # until the third request is admitted, or the streams end
        now = scrape(server)
        if now["vllm:num_requests_waiting"] == 1 or now["vllm:num_requests_running"] < 2:
            seen_waiting = now["vllm:num_requests_waiting"] == 1
            break
    for t in threads:
        t.join()
    assert len(done) == 3
    assert running["vllm:num_requests_running"] == 2
    assert 0 < running["vllm:kv_cache_usage_perc"] <= 1
    assert seen_waiting
    after = scrape(server)
    assert after["vllm:num_requests_running"] == 0 == after["vllm:num_requests_waiting"]


def test_preemptions_are_counted():
    """Four prompts of 190 tokens in a KV room for one sequence and 32 tokens more: the batch
    preempts, and the counter says so."""
    proc = ServeProcess("--max-prompt-len", "256", "--min-response-len", "32",
                        "-p", "prefix_cache_tokens=32", "-p", "max_num_seqs=4")  # fmt: skip
    try:
        before = scrape(proc)
        usages: list[dict] = []

        def one(i: int) -> None:
            words = " ".join(f"item{i}x{j}" for j in range(40))
            body = {"model": MODEL, "prompt": words, "max_tokens": 40, "ignore_eos": True}
            usages.append(httpx.post(proc.url + "/completions", json=body, timeout=300).json())

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [u["usage"]["completion_tokens"] for u in usages] == [40] * 4
        after = scrape(proc)
        assert moved(before, after, "vllm:num_preemptions_total") > 0
        # a preempted prompt is looked up again when it is read again
        assert moved(before, after, "vllm:prefix_cache_queries_total") > 4 * 190 - 1
        assert moved(before, after, "vllm:generation_tokens_total") == 160
    finally:
        assert proc.stop() == 0, proc.stderr()


def test_continuous_usage_on_every_chunk(server):
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    chunks = []
    with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 8
    assert len({u["prompt_tokens"] for u in usages}) == 1
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    # OpenAI's include_obfuscation is taken; a key neither OpenAI nor vLLM has is named
    body["stream_options"] = {"include_usage": True, "include_obfuscation": False}
    assert httpx.post(server.url + "/chat/completions", json=body, timeout=120).status_code == 200
    body["stream_options"] = {"include_usage": True, "frobnicate": True}
    refused = httpx.post(server.url + "/chat/completions", json=body, timeout=30)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "stream_options.frobnicate"


def test_tokenize_detokenize_version(server, client):
    messages = [{"role": "user", "content": "What is 7 times 8?"}]
    tokens = httpx.post(server.root + "/tokenize", json={"model": MODEL, "messages": messages},
                        timeout=30).json()  # fmt: skip
    used = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert tokens["count"] == len(tokens["tokens"]) == used.prompt_tokens
    assert tokens["max_model_len"] > 0 and tokens["token_strs"] is None
    text = httpx.post(server.root + "/tokenize", json={"prompt": "Hello world",
                      "return_token_strs": True}, timeout=30).json()  # fmt: skip
    assert "".join(text["token_strs"]) == "Hello world"
    back = httpx.post(server.root + "/detokenize", json={"tokens": text["tokens"]}, timeout=30)
    assert back.json() == {"prompt": "Hello world"}
    bad = httpx.post(server.root + "/tokenize", json={"prompt": "x", "frob": 1}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "frob"
    version = httpx.get(server.root + "/version", timeout=30).json()["version"]
    assert version.startswith(__import__("npuw_kv").__version__.split("+")[0])


def guidellm_command() -> list[str]:
    """guidellm's CLI: ``$NPUW_KV_GUIDELLM`` (a path, e.g. in a venv of its own), else the
    ``guidellm`` on PATH.  Missing, the test fails: install it (``pip install guidellm``)."""
    given = os.environ.get("NPUW_KV_GUIDELLM") or shutil.which("guidellm")
    if given:
        return [given]
    return [sys.executable, "-m", "guidellm"]


def test_guidellm_at_its_defaults_runs_without_errors(server, tmp_path):
    """guidellm's own request shape (streamed chat with include_usage and
    continuous_usage_stats): a short synchronous run, every request answered, TTFT reported."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Why is the sky blue?\nName three fruits.\nWhat is 7 times 8?\n")
    report = tmp_path / "report.json"
    done = subprocess.run(
        [*guidellm_command(), "run", f"--backend=kind=openai_http,target={server.root}",
         "--profile=kind=synchronous", "--constraint=kind=max_requests,count=3",
         f"--data=kind=text_file,path={prompts}", "--disable-console-interactive",
         f"--output=kind=json,path={report}"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bench = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    assert bench["request_totals"] == {"successful": 3, "errored": 0, "incomplete": 0, "total": 3}
    ttft = bench["time_to_first_token_ms"]["successful"]
    assert ttft["count"] == 3 and ttft["mean"] > 0
