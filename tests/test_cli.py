"""The ``npuw-kv`` command line on the default model."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from npuw_kv.cli.commands import main


def test_inspect_prints_layout_and_shapes(capsys):
    assert main(["inspect", "--chunk", "128", "--max-prompt-len", "300"]) == 0
    out = capsys.readouterr().out
    assert "layers           30" in out and "kv heads         3" in out
    assert "trained context  8192 positions (GGUF llama.context_length)" in out
    assert "head_dim         64" in out and "attention window full" in out
    assert "attention_backend pa" in out and "chunks of 128 tokens, prompts up to 384" in out
    assert "KV cache         512 tokens" in out and "u8" in out  # 384 + 128, the plugin's blocks
    import openvino as ov

    present = ov.Core().available_devices
    assert f"devices present  {', '.join(present)}" in out
    assert ("no NPU" in out) == ("NPU" not in present)
    argv = ["inspect", "--chunk", "128", "--max-prompt-len", "300", "-p", "PREFIX_CACHE_TOKENS=64"]
    assert main(argv) == 0
    assert "512 tokens in the device's blocks, + 64 for cached prefixes" in capsys.readouterr().out
    assert (
        main(["inspect", "--chunk", "128", "--max-prompt-len", "300", "--attention", "sdpa"]) == 0
    )
    out = capsys.readouterr().out
    assert "input_ids [1,128]  attention_mask [1,384]  past [1,3,256,64]" in out
    assert "attention_mask [1,512]" in out  # generate: 384 + 128
    assert "prefix store" not in out
    argv += ["--attention", "sdpa"]
    assert main(argv) == 0  # PREFIX_CACHE_TOKENS=64: two blocks on the host, one for restores
    assert "prefix store     64 tokens of earlier prompts on the host (+ 32" in (
        capsys.readouterr().out
    )
    # the NPU path cuts the KV buffer where its models' pasts end (V not transposed off an NPU)
    assert main(["inspect", "--device", "NPU", "--max-prompt-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "prefill pasts    1792, 3840" in out and "generate pasts   1280, 4223" in out
    assert "KV blocks        cut at slots 1280, 1792, 3840" in out


def test_generate_streams_text(capsys):
    assert (
        main(["generate", "-n", "6", "--exact", "--no-chat-template", "The capital of France is"])
        == 0
    )
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "finish=length" in captured.err and "ms/token" in captured.err


def test_sampling_flags_sample_reproducibly_and_version_prints(capsys):
    """--temperature / --top-p / --top-k / --seed sample (the same seed, the same text; another
    seed, another); without them decoding is greedy.  --version names the package version."""
    argv = ["generate", "-n", "12", "--no-chat-template", "Once upon a time"]
    sampled = ["--temperature", "1.5", "--top-k", "50", "--top-p", "0.95"]
    texts = []
    for seed in ("1", "1", "2"):
        assert main([*argv, *sampled, "--seed", seed]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] != texts[2]
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("npuw-kv 0.")


def test_the_cli_speaks_in_one_line_each(capsys):
    """A warning is one line; a too-long prompt's error names the option; without an NPU,
    ``-d NPU`` says once that NPUW runs on the CPU."""
    proc = subprocess.run(
        [sys.executable, "-m", "npuw_kv.cli", "generate", "-n", "2"]
        + ["-p", "PREFILL_ATTENTION=pyramid", "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    warned = [line for line in err.splitlines() if "warning" in line]
    assert warned and warned[0].startswith("npuw-kv: warning: prefill_attention")
    assert "warnings.warn" not in err and "return cls(" not in err  # not Python's two lines
    assert main(["generate", "-n", "2", "--max-prompt-len", "32", "--chunk", "32", "w " * 60]) == 2
    assert "(on the command line: --max-prompt-len)" in capsys.readouterr().err
    assert main(["generate", "-d", "NPU", "-n", "1", "--max-prompt-len", "64", "hi"]) == 0
    err = capsys.readouterr().err
    assert err.count("no NPU here: NPUW runs its sub-models on the CPU") == 1


def test_bad_settings_exit_2_with_the_reason(capsys):
    assert main(["generate", "--chunk", "0", "hi"]) == 2
    assert "PREFILL_CHUNK_SIZE" in capsys.readouterr().err
    assert main(["generate", "-p", "NOT_A_SETTING=1", "hi"]) == 2
    assert "unknown setting" in capsys.readouterr().err


def test_a_setting_without_a_value_is_a_usage_error(capsys):
    """``-p FOO``: exit 2 naming the setting, before the model is loaded."""
    for bad in ("FOO", "=1"):
        with pytest.raises(SystemExit) as exc:
            main(["generate", "-p", bad, "hi"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --prop/-p: expected KEY=VALUE, got {bad!r}" in err


def test_chat_repl_keeps_going_until_exit():
    proc = subprocess.run(
        [sys.executable, "-m", "npuw_kv.cli", "chat", "-n", "8"],
        input="Hello!\n/reset\nSay hi.\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") >= 3  # three prompts shown before /exit
    assert len(proc.stdout.replace("> ", "").strip()) > 10  # two answers were streamed


def test_chat_commands_are_the_repls_and_never_reach_the_model():
    """/help lists the commands, /reset says it cleared the history, an unknown /command and a
    line of NUL bytes are refused by the REPL: no answer is generated for any of them."""
    proc = subprocess.run(
        [sys.executable, "-m", "npuw_kv.cli", "chat", "-n", "4"],
        input="/help\n/bogus and more\n\x00\x00\n/reset\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "/reset" in proc.stderr and "/exit" in proc.stderr  # the /help list
    assert "unknown command /bogus: /help lists the commands" in proc.stderr
    assert "only NUL bytes" in proc.stderr and "[history cleared]" in proc.stderr
    assert proc.stdout.replace("> ", "").strip() == ""  # the model said nothing


def test_chat_repl_drops_old_exchanges_instead_of_failing():
    """Past MAX_PROMPT_LEN the REPL says it dropped the oldest exchanges and still answers."""
    proc = subprocess.run(
        [sys.executable, "-m", "npuw_kv.cli", "chat", "-n", "12"]
        + ["--max-prompt-len", "96", "--chunk", "32"],
        input="".join(f"Tell me fact number {i} about the sea.\n" for i in range(6)) + "/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "oldest exchange(s) dropped to fit MAX_PROMPT_LEN" in proc.stderr
    assert "error" not in proc.stderr
    answers = [a for a in proc.stdout.split("> ") if a.strip()]
    assert len(answers) >= 6, proc.stdout  # every message got an answer


def test_bench_runs_with_explicit_static_shapes(capsys, tmp_path):
    """``bench`` with ``--max-prompt-len`` / ``--min-response-len`` sizes the KV from them."""
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--runtimes", "npuw-kv", "--prompt-len", "100", "--new-tokens", "4"]
    argv += ["--repeats", "1", "--chunk", "64", "--max-prompt-len", "192"]
    argv += ["--min-response-len", "64", "--kv-precision", "f16", "--json", str(out_json)]
    assert main(argv) == 0
    assert "failed" not in capsys.readouterr().out
    (row,) = json.loads(out_json.read_text())
    assert row["runtime"] == "npuw-kv" and len(row["tokens"]) == 4
    # 30 layers x K,V x 3 heads x 64 dims x f16, for TOTAL - 1 = 192 + 64 - 1 slots
    assert row["kv_bytes"] == 30 * 2 * 3 * 64 * 2 * (192 + 64 - 1)
    assert row["peak_rss_mb"] > 0 and row["ttft_s"] > 0
    assert 0 < row["load_rss_mb"] <= row["peak_rss_mb"]
    assert row["reused_tokens"] == 0  # the repeated prompt was run cold, not from the cache


def test_bench_static_path_reports_chunk_time_by_past(capsys, tmp_path):
    """The static-shape path's row comes with what a prefill chunk took at each past length."""
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--runtimes", "npuw-kv-npu", "--prompt-len", "100", "--new-tokens", "2"]
    argv += ["--repeats", "1", "--chunk", "32", "--max-prompt-len", "128"]
    argv += ["--min-response-len", "16", "--json", str(out_json)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    (row,) = json.loads(out_json.read_text())
    # 100 tokens in 4 chunks of 32, on the lean ladder's pasts (no generate variant at this
    # length: two rungs where a full prompt's chunks read the fewest slots, 0 and 32, and 96)
    runs = [(past, n) for past, _, n in row["prefill_ms_by_past"]]
    assert runs == [(0, 1), (32, 1), (96, 2)]
    assert all(ms > 0 for _, ms, _ in row["prefill_ms_by_past"])
    line = next(x for x in out.splitlines() if x.startswith("npuw-kv-npu prefill chunk ms by past"))
    assert "(1), 32: " in line and "(1), 96: " in line and line.endswith("(2)")
    assert 0 < row["load_rss_mb"] <= row["peak_rss_mb"]


def test_chunk_times_are_grouped_by_past():
    from npuw_kv.tools.bench_worker import chunk_ms_by_past

    grouped = chunk_ms_by_past([64, 0, 64, 112], [30.0, 10.0, 50.0, 70.0])
    assert grouped == [[0, 10.0, 1], [64, 40.0, 2], [112, 70.0, 1]]
    with pytest.raises(ValueError, match="3 chunk pasts but 2 chunk times"):
        chunk_ms_by_past([0, 16, 32], [1.0, 2.0])


def test_bench_device_picks_our_runtime_and_conflicts_are_reported(capsys):
    """``bench --device`` picks our path; with ``--runtimes`` too it is an error, not ignored."""
    from npuw_kv.tools.bench import _runtimes

    assert _runtimes(None, None) == ["npuw-kv", "genai-cpu"]
    assert _runtimes(None, "npu") == ["npuw-kv-npu", "genai-cpu"]
    assert _runtimes("genai-sdpa, npuw-kv", None) == ["genai-sdpa", "npuw-kv"]
    assert main(["bench", "--device", "NPU", "--runtimes", "npuw-kv"]) == 2
    assert "either --device or --runtimes" in capsys.readouterr().err
    assert main(["bench", "--device", "GPU"]) == 2
    assert "--device must be CPU or NPU" in capsys.readouterr().err
    assert main(["bench", "--runtimes", "npuw-kv,vllm"]) == 2
    assert "unknown runtime(s) ['vllm']" in capsys.readouterr().err


def _fake_bench_worker(monkeypatch, fail=()):
    """Replace the bench subprocesses: ``fail`` runtimes fail, the others give a fixed result."""
    import npuw_kv.tools.bench as bench

    calls = []

    def worker(runtime, args, extra):
        calls.append((runtime, args.prompt_len, args.new_tokens, args.repeats))
        if runtime in fail:
            return {"runtime": runtime, "error": f"CapacityError: {runtime} broke"}
        result = {"runtime": runtime, "ttft_s": 0.5, "ms_per_token": 10.0, "peak_rss_mb": 400.0}
        result.update(load_s=1.0, tokens=[1, 2, 3])
        if runtime.startswith("npuw-kv"):
            result.update(kv_bytes=2**20, host_copied=0, switch_copied=0)
        return result

    monkeypatch.setattr(bench, "_run_worker", worker)
    return calls


def test_bench_counts_below_their_minimum_are_argparse_errors(capsys, monkeypatch):
    """Counts below their minimum: exit 2 naming the option, nothing run.  ``--new-tokens``
    needs 2, since a decode rate needs a second token."""
    calls = _fake_bench_worker(monkeypatch)
    for option, low, values in (
        ("--repeats", 1, ("0", "-1")),
        ("--prompt-len", 1, ("0", "-1")),
        ("--new-tokens", 2, ("1", "0")),
    ):
        for value in values:
            with pytest.raises(SystemExit) as exc:
                main(["bench", "--runtimes", "npuw-kv", option, value])
            assert exc.value.code == 2
            err = capsys.readouterr().err
            assert f"argument {option}: must be at least {low}" in err and f"got {value}" in err
    assert calls == []


def test_bench_exit_code_1_when_a_runtime_fails(capsys, tmp_path):
    """A runtime that fails (here: the prompt outgrows MAX_PROMPT_LEN) is a row, and exit code 1."""
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--runtimes", "npuw-kv", "--prompt-len", "300", "--max-prompt-len", "256"]
    argv += ["--new-tokens", "2", "--repeats", "1", "--json", str(out_json)]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert re.search(r"^runtime +TTFT s", captured.out, re.M)
    row = next(line for line in captured.out.splitlines() if line.startswith("npuw-kv "))
    assert "failed:" in row and "CapacityError" in row and "MAX_PROMPT_LEN is 256" in row
    assert "npuw-kv bench: failed: npuw-kv" in captured.err
    (result,) = json.loads(out_json.read_text())
    assert "CapacityError" in result["error"]


def test_bench_prints_the_whole_table_then_exits_1_on_any_failure(capsys, monkeypatch):
    """One failed runtime among several: every row is printed, the failure too, then exit 1."""
    _fake_bench_worker(monkeypatch, fail={"npuw-llm"})
    assert main(["bench", "--runtimes", "npuw-kv,npuw-llm,genai-cpu"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.startswith("npuw-kv ") and "0.500" in line for line in lines)
    assert f"{'npuw-llm':<19} failed: CapacityError: npuw-llm broke" in lines
    assert any(line.startswith("genai-cpu ") and "0.500" in line for line in lines)
    assert "npuw-kv / genai-cpu: TTFT x1.00" in out  # the summary still follows the table
    _fake_bench_worker(monkeypatch)
    assert main(["bench", "--runtimes", "npuw-kv,genai-cpu"]) == 0


def test_bench_quick_with_an_explicit_length_is_an_error(capsys, monkeypatch):
    """``--quick`` fixes 1000 + 64 tokens and one timed run: ``--prompt-len`` / ``--new-tokens``
    with it is exit 2."""
    calls = _fake_bench_worker(monkeypatch)
    for extra in (["--prompt-len", "50"], ["--new-tokens", "8"], ["--prompt-len", "1000"]):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "--runtimes", "npuw-kv", "--quick", *extra])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--quick fixes the prompt at ~1000 tokens and 64 new tokens" in err
        assert f"drop --quick or {extra[0]}" in err
    assert calls == []
    assert main(["bench", "--runtimes", "npuw-kv", "--quick"]) == 0
    assert main(["bench", "--runtimes", "npuw-kv", "--prompt-len", "50"]) == 0
    assert main(["bench", "--runtimes", "npuw-kv", "--new-tokens", "8", "--repeats", "1"]) == 0
    assert calls == [("npuw-kv", 1000, 64, 1), ("npuw-kv", 50, 64, 3), ("npuw-kv", 1000, 8, 1)]
    assert "prompt 50 tokens of stdlib docstrings, 64 new tokens" in capsys.readouterr().out


def test_inspect_model_given_twice_is_an_error(capsys, monkeypatch):
    """``inspect -m A B`` names two models: exit 2 naming both; either alone is the model."""
    import npuw_kv.cli.describe

    seen = []
    monkeypatch.setattr(npuw_kv.cli.describe, "describe", lambda m, *a, **k: seen.append(m))
    with pytest.raises(SystemExit) as exc:
        main(["inspect", "-m", "smollm2", "/nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--model/-m 'smollm2'" in err and "MODEL '/nope'" in err
    assert seen == []
    assert main(["inspect", "/nope"]) == 0
    assert main(["inspect", "-m", "/nope"]) == 0
    assert main(["inspect", "--model", "/nope", "/nope"]) == 0  # the same model twice is fine
    assert main(["inspect"]) == 0
    assert seen == ["/nope", "/nope", "/nope", None]


def test_generate_of_one_token_reports_no_rate(capsys):
    """``-n 1``: no decode step, so the stats line gives the count and TTFT, no ms/token;
    ``-n 0`` is refused, as genai's GenerationConfig refuses it (exit 2, no traceback)."""
    assert main(["generate", "-n", "1", "--no-chat-template", "hi"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"\[1 tokens, finish=\w+, TTFT \d+ ms\]", err), err
    assert "ms/token" not in err
    assert main(["generate", "-n", "0", "--no-chat-template", "hi"]) == 2
    assert "max_new_tokens must be > 0 (0 only with echo=True)" in capsys.readouterr().err


def test_bench_prefix_reuse_override_reaches_the_worker():
    """Runs are cold by default; ``-p PREFIX_REUSE=YES`` (any spelling) turns reuse back on."""
    from npuw_kv.tools.bench_worker import measure

    shapes = {"prefill_chunk_size": 32}
    cold = measure("npuw-kv", None, 40, 2, 1, shapes, 64, 8)
    warm = measure("npuw-kv", None, 40, 2, 1, {**shapes, "PREFIX_REUSE": "YES"}, 64, 8)
    assert cold["reused_tokens"] == 0 and warm["reused_tokens"] > 0


def test_bench_chunk_reaches_npuw_llm_as_well_as_ours(monkeypatch):
    """``--chunk`` (or any of its names) is one of the static shapes: every worker gets it, and
    NPUW's LLM pipeline is built with it, not with a chunk of its own (256 when none is given)."""
    import openvino_genai

    from npuw_kv.tools.bench_worker import genai_pipeline

    seen = []

    def worker(runtime, args, extra):
        seen.append((runtime, args.chunk, dict(extra)))
        return {"runtime": runtime, "error": "not run"}

    monkeypatch.setattr("npuw_kv.tools.bench._run_worker", worker)
    for flags in (["--chunk", "512"], ["-p", "NPUW_LLM_PREFILL_CHUNK_SIZE=512"]):
        seen.clear()
        main(["bench", "--runtimes", "npuw-kv-npu,npuw-llm", *flags])
        assert [(r, c) for r, c, _ in seen] == [("npuw-kv-npu", 512), ("npuw-llm", 512)]
        assert all("CHUNK" not in k.upper() for _, _, extra in seen for k in extra)

    built = []
    monkeypatch.setattr(openvino_genai, "LLMPipeline", lambda *a, **kw: built.append(kw))
    genai_pipeline("npuw-llm-pyramid", "m", {}, 4096, 128, 512)
    genai_pipeline("npuw-llm", "m", {}, 1024, 128)
    genai_pipeline("npuw-llm-static", "m", {}, 1024, 128)
    genai_pipeline("npuw-llm-static", "m", {"NPUW_LLM_GENERATE_PYRAMID": "YES"}, 1024, 128)
    assert [kw["NPUW_LLM_PREFILL_CHUNK_SIZE"] for kw in built] == [512, 256, 256, 256]
    assert built[0]["NPUW_LLM_PREFILL_ATTENTION_HINT"] == "PYRAMID"
    # npuw-llm is NPUW's defaults as they are; npuw-llm-static asks for its static path, and a
    # setting given with -p still wins
    assert "NPUW_LLM_PREFILL_ATTENTION_HINT" not in built[1]
    hints = [
        (kw["NPUW_LLM_PREFILL_ATTENTION_HINT"], kw["NPUW_LLM_GENERATE_PYRAMID"]) for kw in built[2:]
    ]
    assert hints == [("STATIC", "NO"), ("STATIC", "YES")]


def test_bench_concurrency_runs_both_pipelines_on_the_same_batch(capsys):
    """A list of prompts, the same prompts from as many threads, and genai's pipeline: the
    same greedy texts from all three."""
    argv = ["bench", "--concurrency", "2", "--new-tokens", "4", "--prompt-len", "20"]
    assert main([*argv, "--repeats", "1"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"npuw-kv-threads: run 1 of 1, \d+ s", err), err  # the workers' progress
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("2 ")]
    assert [r[1] for r in rows[:3]] == ["npuw-kv", "npuw-kv-threads", "genai-cpu"], out
    assert rows[1][-1] == rows[2][-1] == "True", out  # the same greedy texts
    ratios = r"2  throughput against genai-cpu: npuw-kv x\d+\.\d\d, npuw-kv-threads x\d+\.\d\d"
    assert re.search(ratios, out), out
    with pytest.raises(SystemExit):
        main(["bench", "--concurrency", "0"])
    assert "--concurrency takes counts >= 1" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["generate", "--chunk", "16", "-p", "prefill_chunk_size=32", "hi"],
         "-p prefill_chunk_size=32 and --chunk 16 set prefill_chunk_size twice"),
        (["generate", "--max-prompt-len", "128", "-p", "NPUW_LLM_MAX_PROMPT_LEN=32", "hi"],
         "and --max-prompt-len 128 set max_prompt_len twice"),
        (["serve", "--api-key", ""], "--api-key is empty"),
    ],
)  # fmt: skip
def test_conflicting_or_empty_settings_exit_2_before_loading(capsys, monkeypatch, argv, said):
    """Neither of two values for one setting wins silently; an empty key does not serve
    openly.  The model is never loaded (the loader refuses)."""

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("npuw_kv.pipeline.LLMPipeline.__init__", no_model)
    assert main(argv) == 2
    assert said in capsys.readouterr().err


@pytest.mark.unit
def test_a_port_beyond_65535_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--port", "99999"])
    assert info.value.code == 2
    assert "must be at most 65535, got 99999" in capsys.readouterr().err


def test_bench_concurrency_on_the_npu_path_scales_against_one_request(capsys):
    """``-d NPU``: the NPU path's packed generate models at N = 1 and 2 (npuw-llm, NPUW's own
    pipeline, cannot compile the GGUF-converted IR: its row says so), the throughput scaled
    against N = 1; a runtime --concurrency does not run is refused by name."""
    argv = ["bench", "--concurrency", "1,2", "-d", "NPU", "--new-tokens", "4", "--prompt-len", "20"]
    assert main([*argv, "--repeats", "1"]) == 1  # npuw-llm failed
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:2] in ("1 ", "2 ")]
    assert [r[1] for r in rows if r[1] == "npuw-kv-npu"] == ["npuw-kv-npu"] * 2, out
    assert "npuw-llm         failed: Broadcast incorrect target shape" in out
    assert re.search(r"2  throughput against N=1: npuw-kv-npu x\d+\.\d\d", out), out
    with pytest.raises(SystemExit):
        main(["bench", "--concurrency", "2", "--runtimes", "genai-sdpa"])
    assert "--concurrency runs npuw-kv, npuw-kv-threads, genai-cpu" in capsys.readouterr().err
