"""A process held to one CPU (``taskset -c 0``, a container's cpuset, a Kubernetes pod with one
exclusive CPU).  OpenVINO's CPU plugin dies there with SIGFPE compiling LLM graphs in bf16, its
default on CPUs with AMX (openvinotoolkit/openvino#33300; openvino-genai's pipeline too), so
npuw-kv computes in f32 there unless told otherwise (``decide.one_cpu_bf16``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openvino as ov
import pytest
from conftest import shared_tiny_ir

from npuw_kv.config import decide
from npuw_kv.config.pipeline_config import PipelineConfig

CHILD = """
import json, sys, warnings
from npuw_kv import LLMPipeline
out = []
for device, backend in (("CPU", "auto"), ("CPU", "sdpa"), ("NPU", "auto")):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        npuw = {"NPUW_ONLINE_PIPELINE": "NONE"} if device == "NPU" else {}  # a tiny graph
        pipe = LLMPipeline(sys.argv[1], device, attention_backend=backend, max_prompt_len=64,
                           min_response_len=16, prefill_chunk_size=16, **npuw)
        tokens = pipe.generate(list(range(50, 90)), max_new_tokens=8, ignore_eos=True).tokens
    out.append({"path": f"{device}/{backend}", "tokens": [int(t) for t in tokens],
                "compute": pipe.engine.decided.compute_precision,
                "warned": any("SIGFPE" in str(w.message) for w in seen)})
print(json.dumps(out))
"""


class _Core:
    """The two CPU properties the decision reads."""

    def __init__(self, default: str, capabilities: list[str]) -> None:
        self.props = {
            "INFERENCE_PRECISION_HINT": default,
            "OPTIMIZATION_CAPABILITIES": capabilities,
        }

    def get_property(self, device: str, name: str):
        assert device == "CPU"
        return self.props[name]


@pytest.mark.unit
@pytest.mark.parametrize(
    "cpus, default, capabilities, given, device, devices, expected",
    [
        (1, "bf16", ["BF16", "FP32"], {}, "CPU", "", True),
        (2, "bf16", ["BF16", "FP32"], {}, "CPU", "", False),  # more than one CPU
        (1, "f32", ["FP32"], {}, "CPU", "", False),  # no bf16 here (AVX2)
        (1, "bf16", ["FP32"], {}, "CPU", "", False),  # a bf16 default the CPU cannot run
        (1, "bf16", ["BF16", "FP32"], {"INFERENCE_PRECISION_HINT": "bf16"}, "CPU", "", False),
        (1, "bf16", ["BF16", "FP32"], {}, "NPU", "CPU", True),  # NPUW's CPU sub-models
        (1, "bf16", ["BF16", "FP32"], {}, "NPU", "NPU", False),  # all on a real NPU
    ],
)
def test_one_cpu_bf16_is_decided_from_the_cpus_and_the_default(
    monkeypatch, cpus, default, capabilities, given, device, devices, expected
):
    monkeypatch.setattr(decide, "usable_cpus", lambda: cpus)
    config = PipelineConfig.from_kwargs(device, **given)
    assert decide.one_cpu_bf16(_Core(default, capabilities), config, devices) is expected


@pytest.mark.npu_path
def test_a_process_on_one_cpu_generates_on_every_path(tmp_path_factory):
    """Every path runs in a process allowed one CPU (it died with SIGFPE while compiling on
    CPUs whose plugin default is bf16); there it computes in f32 and says why, once a
    pipeline; elsewhere nothing changes."""
    model = shared_tiny_ir(
        tmp_path_factory, tmp_path_factory.mktemp("one-cpu") / "ir", std=0.3, seed=3
    )
    one = min(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model)],
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lambda: os.sched_setaffinity(0, {one}),
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    bf16_default = decide.cpu_precision(ov.Core(), PipelineConfig.from_kwargs("CPU")) == "bf16"
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["path"] for r in runs] == ["CPU/auto", "CPU/sdpa", "NPU/auto"]
    for run in runs:
        assert len(run["tokens"]) == 8, run
        assert run["warned"] is bf16_default, run
        if bf16_default:
            assert run["compute"] == "f32", run
