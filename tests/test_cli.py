"""The ``npuw-kv`` command line on the default model."""

from __future__ import annotations

import json
import subprocess
import sys

from npuw_kv.cli import main


def test_inspect_prints_layout_and_shapes(capsys):
    assert main(["inspect", "--chunk", "128", "--max-prompt-len", "300"]) == 0
    out = capsys.readouterr().out
    assert "layers           30" in out and "kv heads         3" in out
    assert "trained context  8192 positions (GGUF llama.context_length)" in out
    assert "head_dim         64" in out and "attention window full" in out
    assert "input_ids [1,128]  attention_mask [1,384]  past [1,3,256,64]" in out
    assert "attention_mask [1,512]" in out  # generate: 384 + 128


def test_generate_streams_text(capsys):
    assert (
        main(["generate", "-n", "6", "--exact", "--no-chat-template", "The capital of France is"])
        == 0
    )
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "finish=length" in captured.err and "ms/token" in captured.err


def test_bad_settings_exit_2_with_the_reason(capsys):
    assert main(["generate", "--chunk", "0", "hi"]) == 2
    assert "PREFILL_CHUNK_SIZE" in capsys.readouterr().err
    assert main(["generate", "-p", "NOT_A_SETTING=1", "hi"]) == 2
    assert "unknown setting" in capsys.readouterr().err


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
    assert "[error]" not in proc.stderr
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
    assert row["reused_tokens"] == 0  # the repeated prompt was run cold, not from the cache


def test_bench_device_picks_our_runtime_and_conflicts_are_reported(capsys):
    """``bench --device`` picks our path; with ``--runtimes`` too it is an error, not ignored."""
    from npuw_kv.bench import _runtimes

    assert _runtimes(None, None) == ["npuw-kv", "genai-cpu"]
    assert _runtimes(None, "npu") == ["npuw-kv-npu", "genai-cpu"]
    assert _runtimes("genai-sdpa, npuw-kv", None) == ["genai-sdpa", "npuw-kv"]
    assert main(["bench", "--device", "NPU", "--runtimes", "npuw-kv"]) == 2
    assert "either --device or --runtimes" in capsys.readouterr().err
    assert main(["bench", "--device", "GPU"]) == 2
    assert "--device must be CPU or NPU" in capsys.readouterr().err
    assert main(["bench", "--runtimes", "npuw-kv,vllm"]) == 2
    assert "unknown runtime(s) ['vllm']" in capsys.readouterr().err
