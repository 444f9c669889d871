"""Soak test: does the resident set stay flat over many calls, and does chat reuse its KV?

Runs one ``LLMPipeline`` for hundreds of calls and prints, every ``--every`` calls, the call
number, RSS and peak RSS (and their ratio to call 20), reused vs prompt tokens and TTFT; then
a summary of the goals, exiting 1 if one fails.

    python scripts/soak.py --mode chat --turns 200          # CPU default (PagedAttention)
    python scripts/soak.py --mode varied --calls 300 --device NPU
    python scripts/soak.py --mode varied --property CPU_RUNTIME_CACHE_CAPACITY=0

Goals.  chat: mean reused tokens >= 50 % of the prompt tokens; mean TTFT <= 0.3x a cold
prompt of the mean length (measured after the loop on the same pipeline with prefix reuse off,
min of 3); peak RSS at the last turn <= 1.05x peak RSS at turn 20.  varied: peak RSS over all
calls <= 1.1x peak RSS after call 20.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

BASELINE_CALL = 20
SYSTEM = "You are a helpful assistant. Answer briefly."
TOPICS = (
    "the capital of France",
    "how rain forms",
    "why the sky is blue",
    "what a prime number is",
    "how a bicycle stays upright",
    "what photosynthesis does",
    "how to boil an egg",
    "why leaves change colour",
    "what a compiler does",
    "how tides work",
    "what an atom is made of",
    "how bees make honey",
)


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set in MB, from /proc/self/status (VmRSS, VmHWM)."""
    values: dict[str, float] = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


@dataclass
class Call:
    """What one call measured."""

    number: int
    prompt_tokens: int
    reused_tokens: int
    ttft_s: float
    rss_mb: float
    peak_mb: float


@dataclass
class Log:
    """The calls so far, printed one line every ``every`` calls."""

    every: int
    calls: list[Call] = field(default_factory=list)

    def add(self, call: Call) -> None:
        self.calls.append(call)
        if call.number % self.every == 0 or call.number == BASELINE_CALL:
            self.print(call)

    def baseline(self) -> Call | None:
        return self.calls[BASELINE_CALL - 1] if len(self.calls) >= BASELINE_CALL else None

    def print(self, call: Call) -> None:
        base = self.baseline()
        ratio = (
            f" (x{call.rss_mb / base.rss_mb:.3f} / x{call.peak_mb / base.peak_mb:.3f} of call "
            f"{BASELINE_CALL})"
            if base is not None
            else ""
        )
        print(
            f"call {call.number:4d}  rss {call.rss_mb:7.1f} MB  peak {call.peak_mb:7.1f} MB{ratio}"
            f"  reused {call.reused_tokens:4d}/{call.prompt_tokens:4d}"
            f"  ttft {1000 * call.ttft_s:7.1f} ms",
            flush=True,
        )


def make_pipeline(args: argparse.Namespace) -> Any:
    """The pipeline under test: the default model with the command line's settings."""
    from npuw_kv import LLMPipeline

    settings: dict[str, Any] = dict(s.split("=", 1) for s in args.set)
    if args.property:
        settings["compile_properties"] = dict(p.split("=", 1) for p in args.property)
    if args.attention != "auto":
        settings["attention_backend"] = args.attention
    if args.chunk:
        settings["prefill_chunk_size"] = args.chunk
    return LLMPipeline(None, args.device, max_prompt_len=args.max_prompt_len, **settings)


def measure(pipe: Any, number: int, run: Callable[[], Any]) -> Call:
    """Run one call and record what it cost."""
    result = run()
    rss, peak = rss_mb()
    reused = int(pipe.kv_stats()["reused_tokens"])
    return Call(number, result.prompt_tokens, reused, result.ttft_s, rss, peak)


def question(i: int) -> str:
    """A short user message that differs from turn to turn."""
    return f"Question {i}: in one sentence, tell me about {TOPICS[i % len(TOPICS)]}."


def run_chat(pipe: Any, turns: int, log: Log) -> None:
    """One chat of ``turns`` turns, the history trimmed to fit as it grows."""
    pipe.start_chat(SYSTEM)
    for i in range(1, turns + 1):
        message = question(i)
        pipe.fit_chat_history(message)
        log.add(
            measure(
                pipe, i, partial(pipe.generate, message, max_new_tokens=24, repetition_penalty=1.1)
            )
        )
    pipe.finish_chat()


def run_varied(pipe: Any, calls: int, max_len: int, seed: int, log: Log) -> None:
    """``calls`` prompts of random length and start in real text, 8 new tokens each."""
    from npuw_kv.tools.prompts import prompt_ids

    text = prompt_ids(pipe.get_tokenizer(), 4 * max_len)
    rng = np.random.default_rng(seed)
    for i in range(1, calls + 1):
        n = int(rng.integers(20, max_len + 1))
        start = int(rng.integers(0, text.size - n))
        ids = text[start : start + n]
        log.add(measure(pipe, i, partial(pipe.generate, ids, max_new_tokens=8, ignore_eos=True)))


def cold_ttft(pipe: Any, tokens: int, repeats: int = 3) -> float:
    """Min TTFT of a prompt of ``tokens`` ids that no cached prefix matches: each repeat starts
    with a token id no earlier prompt started with, so nothing can be reused."""
    from npuw_kv.tools.prompts import prompt_ids

    text = prompt_ids(pipe.get_tokenizer(), tokens - 1)
    times = []
    for r in range(repeats):
        first = pipe.vocab_size - 1 - 97 * r - time.time_ns() % 89
        ids = np.concatenate([[first], text])
        times.append(pipe.generate(ids, max_new_tokens=1).ttft_s)
        assert pipe.kv_stats()["reused_tokens"] == 0
    return min(times)


@dataclass
class Goal:
    name: str
    value: float
    limit: float
    at_most: bool = True  # False: the value must reach the limit

    @property
    def ok(self) -> bool:
        return self.value <= self.limit if self.at_most else self.value >= self.limit

    def line(self) -> str:
        sign = "<=" if self.at_most else ">="
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.value:.3f} {sign} {self.limit}"


def chat_goals(pipe: Any, log: Log) -> list[Goal]:
    """Reuse, TTFT and peak-RSS goals of a chat run."""
    calls, base = log.calls, log.baseline()
    prompt = float(np.mean([c.prompt_tokens for c in calls]))
    reused = float(np.mean([c.reused_tokens for c in calls]))
    ttft = float(np.mean([c.ttft_s for c in calls]))
    cold = cold_ttft(pipe, round(prompt))
    print(
        f"mean prompt {prompt:.0f} tokens, mean reused {reused:.0f}; mean TTFT "
        f"{1000 * ttft:.1f} ms, cold TTFT at {round(prompt)} tokens {1000 * cold:.1f} ms",
        flush=True,
    )
    goals = [
        Goal("mean reused / mean prompt tokens", reused / prompt, 0.5, at_most=False),
        Goal("mean TTFT / cold TTFT", ttft / cold, 0.3),
    ]
    if base is not None:
        goals.append(
            Goal(
                f"peak RSS turn {calls[-1].number} / turn {BASELINE_CALL}",
                calls[-1].peak_mb / base.peak_mb,
                1.05,
            )
        )
    return goals


def varied_goals(log: Log) -> list[Goal]:
    """The peak-RSS goal of a varied-length run."""
    calls, base = log.calls, log.baseline()
    if base is None:
        return []
    return [
        Goal(
            f"peak RSS call {calls[-1].number} / call {BASELINE_CALL}",
            calls[-1].peak_mb / base.peak_mb,
            1.1,
        )
    ]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("chat", "varied"), default="chat")
    parser.add_argument("--turns", type=int, default=200, help="chat turns (chat mode)")
    parser.add_argument("--calls", type=int, default=300, help="prompts (varied mode)")
    parser.add_argument("--device", choices=("CPU", "NPU"), default="CPU")
    parser.add_argument("--attention", choices=("auto", "pa", "sdpa"), default="auto")
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=0, help="prefill chunk (0: default)")
    parser.add_argument("--every", type=int, default=10, help="print every N calls")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a pipeline setting, e.g. prefix_reuse=NO",
    )
    parser.add_argument(
        "--property",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an OpenVINO compile property, e.g. CPU_RUNTIME_CACHE_CAPACITY=0",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    started = time.perf_counter()
    pipe = make_pipeline(args)
    rss, peak = rss_mb()
    print(
        f"loaded in {time.perf_counter() - started:.1f} s: rss {rss:.1f} MB, "
        f"peak {peak:.1f} MB; {vars(args)}",
        flush=True,
    )
    log = Log(args.every)
    if args.mode == "chat":
        run_chat(pipe, args.turns, log)
        goals = chat_goals(pipe, log)
    else:
        max_len = min(1020, pipe.config.max_prompt_len)
        run_varied(pipe, args.calls, max_len, args.seed, log)
        goals = varied_goals(log)
    print(
        f"summary ({args.mode}, {args.device}, attention {args.attention}, "
        f"{time.perf_counter() - started:.0f} s):",
        flush=True,
    )
    for goal in goals:
        print("  " + goal.line(), flush=True)
    return 0 if all(goal.ok for goal in goals) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
