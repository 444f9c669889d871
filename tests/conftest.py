"""Shared fixtures: the real SmolLM2 model, tiny random Llamas, and exact f32 references.

Nothing here skips: if the model package or OpenVINO is missing, the fixtures fail loudly.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
from functools import cache
from pathlib import Path

# Ray clusters in the tests live on 127.0.0.1: Ray reads this when it is first imported
# (npuw_kv/cluster/local.py)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np
import openvino as ov
import openvino_genai
import pytest

from npuw_kv.config.settings import EXACT_F32
from npuw_kv.model.source import resolve_model
from npuw_kv.pipeline import LLMPipeline
from npuw_kv.tools.prompts import prompt_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from make_tiny_gguf import make_tiny_gguf  # noqa: E402
from make_tiny_optimum_ir import make_tiny_optimum_ir  # noqa: E402

CHUNK = 256
MAX_PROMPT = 1024
MIN_RESPONSE = 64
# the NPU path on the tiny model: chunks of 16, exact f32, and NPUW's partitioning off (it
# cannot run these tiny graphs: test_tiny_model.py)
# npuw-kv serve at the settings of f32_pipe: exact f32 compute and KV on the paged path
EXACT_SERVE_ARGS = (
    "--exact", "--kv-precision", "f32", "--chunk", "256", "--max-prompt-len", "1024",
    "--min-response-len", "64", "--attention", "pa",
)  # fmt: skip
TINY_CHUNK = 16
TINY_NPU: dict = dict(
    prefill_chunk_size=TINY_CHUNK,
    max_prompt_len=4 * TINY_CHUNK,
    min_response_len=24,
    NPUW_ONLINE_PIPELINE="NONE",
    **EXACT_F32,
)


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir: Path) -> openvino_genai.Tokenizer:
    return openvino_genai.Tokenizer(str(smol_dir))


@pytest.fixture(scope="session")
def text_ids(smol_tokenizer):
    """``text_ids(n)``: the first n ids of the stdlib-docstring text."""
    return lambda n: prompt_ids(smol_tokenizer, n)


@pytest.fixture(scope="session")
def genai_reference(smol_dir: Path):
    """Greedy tokens from openvino-genai's CPU pipeline with f32 KV and exact f32 compute."""
    pipe = openvino_genai.LLMPipeline(str(smol_dir), "CPU", KV_CACHE_PRECISION="f32", **EXACT_F32)

    @cache
    def run(ids: tuple[int, ...], new_tokens: int) -> list[int]:
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = new_tokens
        config.ignore_eos = True
        result = pipe.generate(ov.Tensor(np.array([ids], np.int64)), config)
        return [int(t) for t in result.tokens[0]]

    return lambda ids, n: run(tuple(int(i) for i in ids), n)


@pytest.fixture(scope="module")
def exact_server():
    """``npuw-kv serve`` at EXACT_SERVE_ARGS, one per test module, stopped with exit code 0."""
    from npuw_kv.serve.child import ServeProcess

    proc = ServeProcess(*EXACT_SERVE_ARGS)
    yield proc
    assert proc.stop() == 0, proc.stderr()


@pytest.fixture(scope="session")
def stateful_logits(smol_dir: Path):
    """``run(ids)``: every row's logits ``[n, vocab]`` from the original stateful IR, exact
    f32 (the request's own output, valid until the next run)."""
    core = ov.Core()
    compiled = core.compile_model(
        core.read_model(str(smol_dir / "openvino_model.xml")),
        "CPU",
        {**EXACT_F32, "KV_CACHE_PRECISION": "f32"},
    )
    request = compiled.create_infer_request()

    def run(ids) -> np.ndarray:
        ids = np.asarray(ids, np.int64).reshape(-1)
        request.reset_state()
        n = len(ids)
        request.infer(
            {
                "input_ids": ids[None],
                "attention_mask": np.ones((1, n), np.int64),
                "position_ids": np.arange(n, dtype=np.int64)[None],
                "beam_idx": np.zeros(1, np.int32),
            }
        )
        return request.get_tensor("logits").data[0]

    return run


@pytest.fixture(scope="session")
def reference_logits(stateful_logits):
    """Logits of the last prompt position from the original stateful IR, exact f32."""
    return lambda ids: stateful_logits(ids)[-1].copy()


@pytest.fixture(scope="session")
def prompt_logprobs_reference(stateful_logits):
    """``run(ids)``: each token's log-probability after the first under the original stateful
    IR's logits (every row, exact f32), what echo with logprobs must give; and the likeliest
    token after each position but the last."""

    def run(ids) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, np.int64).reshape(-1)
        logits = stateful_logits(ids).astype(np.float64)
        top = logits.max(axis=1, keepdims=True)
        logs = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
        return logs[np.arange(len(ids) - 1), ids[1:]], logs[:-1].argmax(axis=1)

    return run


_PIPES: dict[tuple, LLMPipeline] = {}
REPORT: list[str] = []  # lines for the end-of-run summary (e.g. max |dlogit| per case)


def pytest_sessionstart(session) -> None:
    """Convert the shipped model into the cache once, before any test runs.

    Under pytest-xdist (the README's test command) this runs in the controller before the
    workers start; otherwise two workers would convert into the same cache folder at once and
    each replace the directory the other reads.  A failure is left to the ``smol_dir`` fixture,
    which then fails every test that needs the model, loudly.
    """
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller did it
        return
    with contextlib.suppress(Exception):
        resolve_model(None)


# the fixtures below that read, convert or compile a model
MODEL_FIXTURES = {
    "smol_dir", "smol_tokenizer", "text_ids", "genai_reference", "reference_logits",
    "smol_pipe", "any_pipe", "tiny_dir", "tiny_reference", "f32_pipe", "genai_f32_pipe",
}  # fmt: skip


class UnitTierError(AssertionError):
    """A test marked ``unit`` compiled a model: it belongs to the full suite, not the quick tier."""


def check_unit_fixtures(nodeid: str, fixturenames: list[str]) -> None:
    """A model fixture is built before a unit test's own fixtures run (a wider scope), so it is
    refused by name instead."""
    models = MODEL_FIXTURES.intersection(fixturenames)
    if models:
        raise UnitTierError(f"{nodeid} is marked unit but uses {sorted(models)}")


@pytest.fixture(autouse=True)
def _unit_tier_builds_no_model(request, monkeypatch) -> None:
    """A ``unit`` test may not compile a model or build a pipeline: the quick tier
    (``pytest -m unit``) stays quick because this is checked, not hoped for."""
    if request.node.get_closest_marker("unit") is None:
        return
    check_unit_fixtures(request.node.nodeid, request.fixturenames)

    def refuse(*args, **kwargs):
        raise UnitTierError(
            f"{request.node.nodeid} is marked unit but builds a model: drop its unit mark"
        )

    monkeypatch.setattr(ov.Core, "compile_model", refuse)
    monkeypatch.setattr(openvino_genai, "LLMPipeline", refuse)
    monkeypatch.setattr(openvino_genai, "ContinuousBatchingPipeline", refuse)


def pytest_collection_modifyitems(config, items) -> None:
    """Files with a ``slow`` test run first, the longest first, whole files kept together.

    The README's command runs two workers that each take whole files (``--dist loadfile``,
    with ``--no-loadscope-reorder`` from pyproject.toml so xdist keeps this order).  Started
    last, a file of several minutes would leave the other worker idle until it ends; started
    first, the short files fill in around it.  ``slow(seconds=...)``: the test's usual time
    here, summed per file.
    """

    def weight(item: pytest.Item) -> float:
        mark = item.get_closest_marker("slow")
        return float(mark.kwargs.get("seconds", 60)) if mark is not None else 0.0

    by_file: dict[str, float] = {}
    for item in items:
        name = item.nodeid.split("::")[0]
        by_file[name] = by_file.get(name, 0.0) + weight(item)
    order = {name: rank for rank, name in enumerate(sorted(by_file, key=lambda n: -by_file[n]))}
    items.sort(key=lambda item: order[item.nodeid.split("::")[0]])


def pytest_sessionfinish(session) -> None:
    """An xdist worker hands its summary lines to the controller (see pytest_testnodedown)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["npuw_kv_report"] = list(REPORT)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist, in the controller: gather a finished worker's summary lines."""
    REPORT.extend(getattr(node, "workeroutput", {}).get("npuw_kv_report", []))


def pytest_terminal_summary(terminalreporter) -> None:
    if REPORT:
        terminalreporter.section("npuw-kv accuracy vs references")
        for line in REPORT:
            terminalreporter.write_line(line)


class RecordingRequest:
    """An infer request that only records the tensors it is given (KVBinding tests)."""

    def __init__(self) -> None:
        self.inputs: dict[str, ov.Tensor] = {}
        self.outputs: dict[int, ov.Tensor] = {}

    def set_tensor(self, name: str, tensor: ov.Tensor) -> None:
        self.inputs[name] = tensor

    def set_output_tensor(self, index: int, tensor: ov.Tensor) -> None:
        self.outputs[index] = tensor


def own_copies(stats: dict) -> int:
    """The host bytes a static-path request copied beyond the strided outputs an NPU's rules
    make it stage (under the NPU rules double, ``NPUW_KV_NPU_IO_DOUBLE=1``: the suite's
    second pass of its static-path tests; elsewhere none are staged for that reason)."""
    staged = stats.get("staged_output_bytes", 0)
    if stats.get("strided_outputs") != "staged":
        return stats["host_bytes_copied"]
    assert staged > 0  # the double refuses strided outputs: some were staged
    return stats["host_bytes_copied"] - staged


def strided_outputs_bound(pipe: LLMPipeline) -> bool:
    """Whether the pipeline binds strided output views (not under an NPU's rules)."""
    return pipe.kv_stats().get("strided_outputs", "direct") == "direct"


def make_pipe(smol_dir: Path, device: str, **extra) -> LLMPipeline:
    """One pipeline per configuration for the whole session (compiling costs seconds)."""
    key = (device, tuple(sorted(extra.items())))
    if key not in _PIPES:
        _PIPES[key] = LLMPipeline(
            smol_dir,
            device,
            prefill_chunk_size=CHUNK,
            max_prompt_len=MAX_PROMPT,
            min_response_len=MIN_RESPONSE,
            **EXACT_F32,
            **extra,
        )
    return _PIPES[key]


@pytest.fixture(scope="session", params=["CPU", "NPU"])
def smol_pipe(request, smol_dir: Path) -> LLMPipeline:
    """The static-shape path (views into one shared buffer) on both devices."""
    return make_pipe(smol_dir, request.param, attention_backend="sdpa")


# label -> (device, settings): every way to run the model, exact f32
BACKENDS = {
    "CPU": ("CPU", {"attention_backend": "sdpa"}),
    "NPU": ("NPU", {}),
    "CPU/pa": ("CPU", {"attention_backend": "pa", "kv_precision": "f32"}),
}


@pytest.fixture(scope="session", params=list(BACKENDS))
def any_pipe(request, smol_dir: Path) -> LLMPipeline:
    device, extra = BACKENDS[request.param]
    pipe = make_pipe(smol_dir, device, **extra)
    pipe.label = request.param  # type: ignore[attr-defined]
    return pipe


def shared_tiny_ir(tmp_path_factory: pytest.TempPathFactory, out: Path, **kwargs) -> Path:
    """``make_tiny_optimum_ir(out, **kwargs)``, exported once per test run: each export costs
    seconds of torch and optimum-intel, and several test files ask for the same tiny model.
    The first caller (in whichever xdist worker) exports it into a folder the workers share,
    under a file lock; every caller gets its own copy at ``out`` (tests may change theirs)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    key = hashlib.sha256(repr(sorted(kwargs.items())).encode()).hexdigest()[:16]
    entry = shared / "tiny-ir-exports" / key
    entry.mkdir(parents=True, exist_ok=True)
    with open(entry / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (entry / "done").exists():
            shutil.rmtree(entry / "ir", ignore_errors=True)  # a worker that died part-way
            make_tiny_optimum_ir(entry / "ir", **kwargs)
            (entry / "done").touch()
    shutil.copytree(entry / "ir", out)
    return out


@pytest.fixture(scope="module", params=["gguf", "optimum-intel"])
def tiny_dir(request, tmp_path_factory) -> Path:
    """A tiny random Llama (4 query / 2 KV heads, head_dim 16, 2 layers) from both sources: a
    GGUF converted by openvino-genai and an optimum-intel IR (whose graph differs in names,
    RoPE, GQA and SDPA form)."""
    root = tmp_path_factory.mktemp("tiny")
    if request.param == "optimum-intel":
        # needs the `optimum` extra and optimum-intel (README's test command installs both)
        return resolve_model(shared_tiny_ir(tmp_path_factory, root / "ir", std=0.2, seed=3))
    gguf = make_tiny_gguf(root / "tiny.gguf", std=0.2, seed=3, dtype="Q8_0")
    return resolve_model(gguf, cache_dir=root / "cache", log=lambda *a, **k: None)


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir):
    """openvino-genai's exact f32 greedy tokens for the tiny model: ``run(ids, n)``."""
    pipe = openvino_genai.LLMPipeline(str(tiny_dir), "CPU", KV_CACHE_PRECISION="f32", **EXACT_F32)

    def run(ids: np.ndarray, n: int) -> list[int]:
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = n
        config.ignore_eos = True
        return [int(t) for t in pipe.generate(ov.Tensor(ids[None]), config).tokens[0]]

    return run


@pytest.fixture(scope="module")
def f32_pipe(smol_dir: Path) -> LLMPipeline:
    """Our exact-f32 pipeline on the CPU default path (PagedAttention, f32 KV cache)."""
    return make_pipe(smol_dir, "CPU", attention_backend="pa", kv_precision="f32")


@pytest.fixture(scope="module")
def genai_f32_pipe(smol_dir: Path) -> openvino_genai.LLMPipeline:
    """openvino-genai's CPU pipeline at exact f32 with an f32 KV cache: f32_pipe's reference."""
    return openvino_genai.LLMPipeline(str(smol_dir), "CPU", KV_CACHE_PRECISION="f32", **EXACT_F32)
