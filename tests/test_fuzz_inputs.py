"""Random keyword values for ``generate`` and random command lines for ``npuw-kv``: each case
ends in an answer or a typed one-line error, never a traceback, a crash or a hang, and the
pipeline answers as before afterwards."""

from __future__ import annotations

import dataclasses
import io
import math
from contextlib import redirect_stderr, redirect_stdout

import pytest
from conftest import make_tiny_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npuw_kv import GenerationConfig, LLMPipeline
from npuw_kv.cli import commands
from npuw_kv.config import PipelineConfig
from npuw_kv.config.settings import EXACT_F32
from npuw_kv.model.source import resolve_model

# a small KV room: whatever a case asks for, generation ends within ~100 tokens
SMALL = {"max_prompt_len": 64, "min_response_len": 32, "prefill_chunk_size": 64, **EXACT_F32}
FIELDS = [f.name for f in dataclasses.fields(GenerationConfig)]
NUMBERS = st.sampled_from([0, 1, 2, 3, -1, 0.5, 1.5, -0.5, 7, 1e9, 2**64, math.nan, math.inf])
VALUES = (
    NUMBERS
    | st.integers(-(2**65), 2**65)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.booleans()
    | st.none()
    | st.text(max_size=6)
    | st.lists(st.integers(-3, 60000) | st.text(max_size=3), max_size=3)
    | st.sets(st.text(max_size=3), max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template: what is fuzzed is how
    ``generate`` and the CLI take their arguments, not the model, and the tiny one answers in
    a millisecond a token (SmolLM2 at exact f32: ~25 ms)."""
    root = tmp_path_factory.mktemp("fuzz")
    gguf = make_tiny_gguf(root / "tiny.gguf", std=0.2, seed=3, dtype="Q8_0")
    model = resolve_model(gguf, cache_dir=root / "cache", log=lambda *a, **k: None)
    return LLMPipeline(model, "CPU", **SMALL)


@pytest.fixture(scope="module")
def baseline(pipe):
    return list(pipe.generate("Hi", max_new_tokens=4).tokens)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=3))
def test_random_generate_keywords(pipe, baseline, fields):
    fields.setdefault("max_new_tokens", 3)
    try:
        result = pipe.generate("Hi", **fields)
    except (ValueError, TypeError) as exc:  # UsageError is both ValueError and RuntimeError
        text = str(exc)
        assert text and "Traceback" not in text
    else:
        answers = getattr(result, "results", [result])
        for answer in answers:
            limit = fields.get("max_new_tokens")
            if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0:
                assert len(answer.tokens) <= limit
            assert all(math.isfinite(p) for p in answer.logprobs)
    assert list(pipe.generate("Hi", max_new_tokens=4).tokens) == baseline


OPTIONS = {
    "-n": st.sampled_from(["0", "1", "3", "-2", "x", "1e3", "99999"]),
    "--temperature": st.sampled_from(["0", "0.7", "-1", "nan", "inf", "hot"]),
    "--top-p": st.sampled_from(["0", "0.9", "1.5", "nan"]),
    "--top-k": st.sampled_from(["0", "5", "-3", "x"]),
    "--seed": st.sampled_from(["1", "-1", "x", str(2**70)]),
    "--repetition-penalty": st.sampled_from(["1", "0", "-1", "nan"]),
    "--frequency-penalty": st.sampled_from(["0", "0.5", "9", "inf"]),
    "--max-prompt-len": st.sampled_from(["64", "0", "-5", "x", "100000000"]),
    "--min-response-len": st.sampled_from(["32", "0", "-1", "x"]),
    "--chunk": st.sampled_from(["64", "0", "3", "x"]),
    "--kv-precision": st.sampled_from(["f32", "u8", "f16", "int3", ""]),
    "--attention": st.sampled_from(["pa", "sdpa", "flash"]),
    "-d": st.sampled_from(["CPU", "cpu", "GPU", "", "NPU"]),
    "-p": st.sampled_from(["max_num_seqs=4", "max_num_seqs=0", "NOPE=1", "=", "x", "a=b=c"]),
    "-m": st.sampled_from(["smollm2", "/nonexistent", "gemma9", ""]),
}
FLAGS = ["--exact", "--no-chat-template", "--gguf-zero-points", "--bogus", "-h"]
PROMPTS = st.sampled_from(["Hi", "", "\x00", "word " * 200, "é" * 3, "--"])


@st.composite
def command_lines(draw):
    command = draw(st.sampled_from(["generate", "inspect", "nonsense", ""]))
    argv = [command] if command else []
    for option in draw(st.lists(st.sampled_from(sorted(OPTIONS)), max_size=4)):
        argv += [option, draw(OPTIONS[option])]
    argv += draw(st.lists(st.sampled_from(FLAGS), max_size=1))
    if command == "generate" and draw(st.booleans()):
        argv.append(draw(PROMPTS))
    return argv


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(command_lines())
def test_random_command_lines(pipe, monkeypatch_module, argv):
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        try:
            code = commands.main(argv)
        except SystemExit as exit_:  # argparse: usage errors, -h
            code = exit_.code
    text = err.getvalue()
    assert "Traceback" not in text, (argv, text)
    assert code in (0, 1, 2), (argv, code, text)
    if code:
        errors = [line for line in text.splitlines() if "error" in line]
        assert errors, (argv, text)


@pytest.fixture(scope="module")
def monkeypatch_module(pipe):
    """The CLI's model loads check their settings as a real load does, then run the shared
    small pipeline, and ``inspect`` checks its settings only (compiling per case would take
    hours)."""
    patch = pytest.MonkeyPatch()

    def load(args):
        device = str(args.device)
        PipelineConfig.from_kwargs(device, **commands.pipeline_kwargs(args))  # its errors
        if device.upper() not in ("CPU", "NPU"):
            raise ValueError(f"device {device!r}: choose CPU or NPU")
        return pipe

    def describe(model, device, **settings):
        PipelineConfig.from_kwargs(device, **settings)
        return f"{model} on {device}"

    patch.setattr(commands, "_load", load)
    patch.setattr("npuw_kv.cli.describe.describe", describe)
    yield patch
    patch.undo()
