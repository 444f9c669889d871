"""Resident memory stays flat over many prompts of different lengths (CPU PagedAttention).

The CPU plugin and oneDNN cache what they build for each input shape; a PagedAttention model
meets a new shape with nearly every prompt length, so unbounded caches grow the process call
after call.  The loop runs in a fresh process so the RSS it compares is the pipeline's alone,
and oneDNN starts from the environment our import sets.  That cache must not be off, though:
the NPU path reuses its kernels on every call, and the bench must run with the size a user gets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import openvino as ov
import pytest

import npuw_kv
from npuw_kv.pipeline import LLMPipeline
from npuw_kv.runtime.device import RUNTIME_CACHE_CAPACITY, limit_runtime_cache
from npuw_kv.runtime.heap import PRIMITIVE_CACHE_CAPACITY, PRIMITIVE_CACHE_ENV

CALLS, BASELINE = 80, 20
SMALL = {"max_prompt_len": 256, "prefill_chunk_size": 256}

# prompts of random length (one chunk each: every length is a new shape) and start in real
# text, 4 new tokens each; prints the RSS (kB) after every call as JSON.  Before the caches were
# bounded: +16 % from call 20 to 80 (421 -> 489 MB); after: +0.2 %
_LOOP = """
import json, sys
import numpy as np
from npuw_kv import LLMPipeline
from npuw_kv.tools.prompts import prompt_ids

calls = int(sys.argv[1])
pipe = LLMPipeline(max_prompt_len=256, prefill_chunk_size=256)
text = prompt_ids(pipe.get_tokenizer(), 1024)
rng = np.random.default_rng(0)
rss = []
for _ in range(calls):
    n = int(rng.integers(8, 257))
    start = int(rng.integers(0, text.size - n))
    pipe.generate(text[start : start + n], max_new_tokens=4, ignore_eos=True)
    with open("/proc/self/status") as status:
        rss.append(next(int(x.split()[1]) for x in status if x.startswith("VmRSS:")))
print(json.dumps(rss))
"""


def _child_env(**extra: str) -> dict[str, str]:
    """This environment, finding the same ``npuw_kv``, without oneDNN cache settings."""
    env = {k: v for k, v in os.environ.items() if k not in PRIMITIVE_CACHE_ENV}
    root = str(Path(npuw_kv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return {**env, **extra}


def _run(code: str, *args: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=_child_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_rss_flat_over_varied_prompt_lengths() -> None:
    rss = json.loads(_run(_LOOP, str(CALLS)))
    base, last = rss[BASELINE - 1], rss[-1]
    assert last <= 1.1 * base, (
        f"RSS grew from {base / 1024:.0f} MB after call {BASELINE} to {last / 1024:.0f} MB "
        f"after call {CALLS}: a per-shape cache is unbounded again"
    )


def test_import_sizes_onednn_primitive_cache() -> None:
    code = (
        "import os\nfrom npuw_kv import LLMPipeline\n"
        "print(os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'))"
    )
    # small, but not none: with none NPUW rebuilds kernels on every call (see below)
    assert 0 < PRIMITIVE_CACHE_CAPACITY <= 64
    assert _run(code) == str(PRIMITIVE_CACHE_CAPACITY)


@pytest.mark.parametrize("name", PRIMITIVE_CACHE_ENV)
def test_users_onednn_cache_size_is_kept(name: str) -> None:
    code = (
        "import os\nfrom npuw_kv import LLMPipeline\n"
        "print(sorted((k, v) for k, v in os.environ.items() if 'PRIMITIVE_CACHE' in k))"
    )
    assert _run(code, **{name: "512"}) == str([(name, "512")])


# The bench and the NPU path with oneDNN's primitive cache; as above, each in a fresh process,
# since oneDNN reads its size once.
_CACHE_ENV = PRIMITIVE_CACHE_ENV[0]  # the name oneDNN reads first


_TOKENIZER_SEES = f"""
import os, sys
import openvino_genai
from npuw_kv.tools import bench_worker

class Stop(Exception):
    pass

class Tokenizer:  # records the cache size oneDNN would read when the tokenizer loads
    def __init__(self, *args, **kwargs):
        print(os.environ.get("{_CACHE_ENV}"))
        raise Stop

openvino_genai.Tokenizer = Tokenizer
try:
    bench_worker.measure(sys.argv[1], sys.argv[2], 8, 1, 1, {{}})
except Stop:
    pass
"""


def test_bench_runs_our_pipeline_with_its_own_onednn_cache(smol_dir) -> None:
    """The bench loads the tokenizer first, which builds oneDNN's first primitive: our
    runtimes must have set the cache size by then (they measured oneDNN's 1024 before), and
    the peers keep oneDNN's own."""
    assert _run(_TOKENIZER_SEES, "npuw-kv-npu", str(smol_dir)) == str(PRIMITIVE_CACHE_CAPACITY)
    assert _run(_TOKENIZER_SEES, "npuw-llm", str(smol_dir)) == "None"


_FAULTS_PER_STEP = """
import resource, sys
import numpy as np
from npuw_kv import LLMPipeline

runner = LLMPipeline(sys.argv[1], "NPU", max_prompt_len=512, min_response_len=64).runner
runner.prefill(np.arange(100, 400))
for token in range(3):  # first calls allocate
    runner.step(100 + token)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for token in range(20):
    runner.step(200 + token)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


@pytest.mark.device_defaults
def test_npu_generate_steps_build_no_kernels_per_call(smol_dir) -> None:
    """Without oneDNN's cache, NPUW on the CPU JIT-compiles a reorder for each strided KV view
    on every call (fresh code pages: ~68 minor faults a step here, ~8 with it)."""
    ours = float(_run(_FAULTS_PER_STEP, str(smol_dir)))
    none = float(_run(_FAULTS_PER_STEP, str(smol_dir), **{_CACHE_ENV: "0"}))
    assert ours <= 0.5 * none, f"{ours} page faults a step, {none} with no primitive cache"


def test_runtime_cache_default_and_override() -> None:
    assert limit_runtime_cache({})["CPU_RUNTIME_CACHE_CAPACITY"] == RUNTIME_CACHE_CAPACITY
    for key in ("CPU_RUNTIME_CACHE_CAPACITY", "cpu_runtime_cache_capacity"):
        assert limit_runtime_cache({key: 5000}) == {key: 5000}


def _compiled_properties(monkeypatch: pytest.MonkeyPatch, **settings: Any) -> dict[str, Any]:
    """The properties an ``LLMPipeline`` compiles its model with (the plugin does not report
    ``CPU_RUNTIME_CACHE_CAPACITY`` back from the compiled model, so the call is watched)."""
    seen: list[dict[str, Any]] = []
    compile_model = ov.Core.compile_model

    def spy(self: ov.Core, model: Any, device: Any = None, config: Any = None) -> Any:
        if isinstance(model, ov.Model):
            seen.append(dict(config or {}))
        return compile_model(self, model, device, config)

    monkeypatch.setattr(ov.Core, "compile_model", spy)
    pipe = LLMPipeline(**SMALL, **settings)
    assert pipe.kv_stats()["kv_binding"] == "paged"
    assert len(seen) == 1
    return seen[0]


def test_runtime_cache_capacity_reaches_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    props = _compiled_properties(monkeypatch)
    assert props["CPU_RUNTIME_CACHE_CAPACITY"] == RUNTIME_CACHE_CAPACITY


def test_users_runtime_cache_capacity_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    props = _compiled_properties(
        monkeypatch, compile_properties={"CPU_RUNTIME_CACHE_CAPACITY": 5000}
    )
    assert props["CPU_RUNTIME_CACHE_CAPACITY"] == 5000
