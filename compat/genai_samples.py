#!/usr/bin/env python3
"""Run openvino.genai's 14 Python text-generation samples as they are and on npuw-kv, offline.

A developer fetches genai (not copied here), then::

    git clone --depth 1 https://github.com/openvinotoolkit/openvino.genai /tmp/genai
    python compat/genai_samples.py --genai /tmp/genai --work /tmp/genai-samples

which runs every sample of ``samples/python/text_generation`` three times on SmolLM2 (the IR
npuw-kv converts, ``--model`` / ``--hf`` for others): with genai as it is, under the class swap
(``openvino_genai.LLMPipeline`` and ``ContinuousBatchingPipeline`` replaced by npuw-kv's before
the sample runs) and under the module swap (a copy of the sample whose ``openvino_genai``
imports name ``npuw_kv``, ``compat/module_swap.py``), and prints a table: whether each run
ended well and whether its text is genai's.  The text compared is the sample's stdout without
its timing and version lines, and of a sample that also samples, its greedy part
(multinomial's text is sampled: only run).  ``--exact`` makes every pipeline compute in f32
without the CPU plugin's dynamic quantization (its properties added by the launcher), where
the default precision (bf16 compute on a CPU that has it, a u8 KV cache) rounds two
implementations apart.  Each run's stdout and stderr are kept under
``--work/<default|exact>/<run>/logs``; a run of genai's own is read from there when
``--runs`` leaves it out.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from module_swap import swapped_tree

HERE = Path(__file__).resolve().parent
SKY = "Why is the sky blue?"
# a timing, a size in memory or a version: not what a run is compared on
MEASURED = re.compile(
    r"\d+(\.\d+)? ?(ms|s|tokens/s|GB|%)\b|version|[Tt]hroughput|duration|time|TTFT|TPOT"
)

SCORE = re.compile(r"(?m)^(-?\d+\.\d+): ")


@dataclass(frozen=True)
class Sample:
    """How a sample is run (``{model}``, ``{hf}``, ``{adapter}``, ``{device}`` filled in)."""

    args: tuple[str, ...]
    stdin: str = ""
    compared: bool = True  # False: its text is sampled, so only run
    after: str = ""  # compare only the text after this (before it: not genai's to compare)
    until: str = ""  # compare only the text before this (after it: sampled, or measured)
    score_places: int | None = None  # a line's leading "score: " compared to this many places


SAMPLES = {
    "greedy_causal_lm": Sample(("{model}", SKY)),
    "multinomial_causal_lm": Sample(("{model}", SKY), compared=False),
    # the beams' scores are sums of f32 log-probabilities: compared to 4 places
    "beam_search_causal_lm": Sample(("{model}", SKY, "What is 2+2?"), score_places=4),
    "chat_sample": Sample(("{model}", "{device}"), stdin="Hi\nWhat is 2+2?\n"),
    "benchmark_genai": Sample(("-m", "{model}", "-M", "20", "-n", "3", "-d", "{device}")),
    "prompt_lookup_decoding_lm": Sample(("{model}", SKY)),
    # the streamed text; the report after it counts what each implementation counts its way
    "speculative_decoding_lm": Sample(("{model}", "{model}", SKY), until="MAIN MODEL"),
    # genai finds no layer of a GGUF-converted IR by name: only the plain answer is its text
    "lora_greedy_causal_lm": Sample(
        ("{model}", "{adapter}", SKY), after="Generate without LoRA adapter:"
    ),
    "react_sample": Sample(("{model}",)),
    "encrypted_model_causal_lm": Sample(("{model}", "Why is the sun yellow?")),
    # the greedy part (the counts, the unconstrained answer); the rest is sampled
    "structured_output_generation": Sample(
        ("{model}",), stdin="Please generate jsons for 1 person and 1 car.\n", until="}\n{"
    ),
    "structural_tags_generation": Sample(("{model}",), until="Using structural tags"),
    "compound_grammar_generation": Sample(("{model}",)),
    # a cache of 8 blocks (256 tokens): the generation length doubles until the cache is full
    "limit_checker": Sample(
        ("--model", "{hf}", "--mode", "gen_length", "--num_kv_blocks", "8", "--device", "{device}")
    ),
}
RUNS = ("openvino-genai", "class swap", "module swap")
# runs a sample as one of RUNS (argv: run, precision, the sample, its arguments); with
# "exact", every pipeline and draft model it makes computes in f32 without the CPU plugin's
# dynamic quantization, so that rounding does not tell two implementations apart
LAUNCHER = """
import runpy, sys
run, precision, script = sys.argv[1:4]
sys.argv = sys.argv[3:]
sys.path.insert(0, script.rpartition("/")[0])
import openvino_genai
into = openvino_genai
if run != "openvino-genai":
    import npuw_kv
if run == "module swap":
    into = npuw_kv
if run == "class swap":
    for name in ("LLMPipeline", "ContinuousBatchingPipeline"):
        setattr(openvino_genai, name, getattr(npuw_kv, name))
EXACT = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
if run == "openvino-genai":  # npuw-kv's paged path keeps f32 KV under the f32 hint by itself
    EXACT["KV_CACHE_PRECISION"] = "f32"  # (a KV precision named would mean its static path)

def exact(make, at):
    def made(*args, **kwargs):
        args = list(args)
        if at is None:
            kwargs.update(EXACT)
        elif len(args) > at:
            args[at] = {**args[at], **EXACT}
        else:
            kwargs["properties"] = {**kwargs.get("properties", {}), **EXACT}
        return make(*args, **kwargs)
    return made

if precision == "exact":
    for name, at in (("LLMPipeline", None), ("draft_model", None),
                     ("ContinuousBatchingPipeline", 3)):
        setattr(into, name, exact(getattr(into, name), at))
runpy.run_path(script, run_name="__main__")
"""


@dataclass
class Outcome:
    returncode: int
    seconds: float
    stdout: str
    stderr: str

    @property
    def error(self) -> str:
        """The last line of stderr that names an error (or the last line)."""
        lines = [line for line in self.stderr.strip().splitlines() if line.strip()]
        named = [line for line in lines if re.match(r"^\w*(Error|Exception)\b", line)]
        return (named or lines or [f"exit {self.returncode}"])[-1][:160]


def compared_text(sample: Sample, stdout: str) -> str:
    """The part of a run's stdout that is compared with genai's."""
    if sample.after:
        stdout = stdout.partition(sample.after)[2]
    if sample.until:
        stdout = stdout.partition(sample.until)[0]
    if sample.score_places is not None:
        places = sample.score_places
        stdout = SCORE.sub(lambda m: f"{float(m.group(1)):.{places}f}: ", stdout)
    return "\n".join(line for line in stdout.splitlines() if not MEASURED.search(line)).strip()


def run_sample(
    name: str, script: Path, run: str, cwd: Path, *, fill: dict[str, str], timeout: float
) -> Outcome:
    sample = SAMPLES[name]
    args = [arg.format(**fill) for arg in sample.args]
    command = [sys.executable, "-c", LAUNCHER, run, fill["precision"], str(script), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    start = time.monotonic()
    try:
        done = subprocess.run(
            command,
            cwd=cwd,
            env=env,
            input=sample.stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        outcome = Outcome(done.returncode, time.monotonic() - start, done.stdout, done.stderr)
    except subprocess.TimeoutExpired as late:
        out = late.stdout.decode() if isinstance(late.stdout, bytes) else late.stdout or ""
        outcome = Outcome(-9, timeout, out, f"TimeoutError: no end within {timeout:.0f} s")
    folder = cwd / "logs"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.out").write_text(outcome.stdout, encoding="utf-8")
    (folder / f"{name}.err").write_text(outcome.stderr, encoding="utf-8")
    (folder / f"{name}.rc").write_text(f"{outcome.returncode} {outcome.seconds:.1f}\n")
    return outcome


def saved(cwd: Path, name: str) -> Outcome | None:
    """A run kept under ``cwd/logs`` by an earlier call (genai's, not run again)."""
    folder = cwd / "logs"
    if not (folder / f"{name}.rc").exists():
        return None
    code, seconds = (folder / f"{name}.rc").read_text().split()
    read = [(folder / f"{name}.{kind}").read_text(encoding="utf-8") for kind in ("out", "err")]
    return Outcome(int(code), float(seconds), *read)


def verdict(name: str, ours: Outcome, genai: Outcome | None) -> str:
    """One cell of the table."""
    if ours.returncode != 0:
        return f"fails: {ours.error}"
    sample = SAMPLES[name]
    if genai is None or not sample.compared:
        return "runs" + ("" if sample.compared else " (sampled: not compared)")
    if genai.returncode != 0:
        return "runs (genai failed: no reference)"
    same = compared_text(sample, ours.stdout) == compared_text(sample, genai.stdout)
    return "runs; = genai" if same else "runs; text differs from genai's"


def lora_adapter(model: Path, work: Path) -> Path:
    """A rank-8 adapter for the model, made once by models/make_lora_adapter.py."""
    adapter = work / "lora.safetensors"
    if not adapter.exists():
        maker = HERE.parent / "models" / "make_lora_adapter.py"
        command = [sys.executable, str(maker), str(model), str(adapter), "--rank", "8"]
        subprocess.run([*command, "--std", "0.05"], check=True)
    return adapter


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--genai", required=True, type=Path, help="a checkout of openvino.genai")
    parser.add_argument("--work", type=Path, default=Path("genai-samples-work"))
    parser.add_argument("--model", type=Path, help="an IR directory (default: SmolLM2's)")
    parser.add_argument("--hf", type=Path, help="the model for optimum (limit_checker)")
    parser.add_argument("--device", default="CPU", help="for the samples that take one")
    parser.add_argument(
        "--runs",
        nargs="+",
        choices=RUNS,
        default=list(RUNS),
        help="which runs (the others' outcomes are read from earlier runs' logs)",
    )
    parser.add_argument("--report", action="store_true", help="run nothing: the logs' table")
    parser.add_argument(
        "--exact",
        action="store_true",
        help="every run in f32 without dynamic quantization (the pipelines' properties)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("samples", nargs="*", help=f"a subset of: {' '.join(SAMPLES)}")
    args = parser.parse_args(argv)
    source = args.genai / "samples" / "python" / "text_generation"
    if not (source / "greedy_causal_lm.py").exists():
        raise SystemExit(f"{args.genai} is not a checkout of openvino.genai")
    root = args.work.resolve()
    work = root / ("exact" if args.exact else "default")
    work.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from genai_suite import model_dirs

        args.model, args.hf = model_dirs(root)
    fill = {"model": str(args.model.resolve()), "device": args.device, "hf": "model_hf"}
    fill["precision"] = "exact" if args.exact else "default"
    names = args.samples or list(SAMPLES)
    if "lora_greedy_causal_lm" in names:
        fill["adapter"] = str(lora_adapter(args.model, root))
    swapped = work / "module-swap-samples"
    print(f"{swapped_tree(source, swapped)} openvino_genai imports swapped in {swapped}")
    results: dict[str, dict[str, Outcome]] = {}
    for run in [] if args.report else args.runs:
        cwd = work / run.replace(" ", "-")
        cwd.mkdir(exist_ok=True)
        for link, target in (("tests", args.genai / "tests"), ("model_hf", args.hf)):
            if target is not None and not (cwd / link).exists():
                (cwd / link).symlink_to(Path(target).resolve())
        shutil.rmtree(cwd / "limit_checker_models", ignore_errors=True)
        for name in names:
            script = (swapped if run == "module swap" else source) / f"{name}.py"
            outcome = run_sample(name, script, run, cwd, fill=fill, timeout=args.timeout)
            results.setdefault(name, {})[run] = outcome
            took = f"exit {outcome.returncode} in {outcome.seconds:.0f} s"
            print(f"{name} ({run}): {took}", flush=True)
    print(table(names, results, work))


def table(names: list[str], results: dict[str, dict[str, Outcome]], work: Path) -> str:
    """The markdown table of every run that ran now or left its logs under ``work``."""
    for name in names:
        for run in RUNS:
            kept = saved(work / run.replace(" ", "-"), name)
            if run not in results.setdefault(name, {}) and kept is not None:
                results[name][run] = kept
    runs = [run for run in RUNS if any(run in results[name] for name in names)]
    lines = [f"| sample | {' | '.join(runs)} |", f"|---|{'---|' * len(runs)}"]
    for name in names:
        genai = results[name].get(RUNS[0])
        cells = [
            "not run"
            if run not in results[name]
            else verdict(name, results[name][run], None if run == RUNS[0] else genai)
            for run in runs
        ]
        lines.append(f"| `{name}` | {' | '.join(cells)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
