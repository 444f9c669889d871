"""Accuracy results as a console table, JSON, a Markdown report and a PNG plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .result import Result

_COLUMNS = (
    "config",
    "tokens",
    "1st div",
    "ref margin",
    "max|dlogit|",
    "mean KL",
    "ppl",
    "ppl ref",
    "recall",
    "tol",
    "ok",
)


def _row(r: Result) -> list[str]:
    def num(x: float, fmt: str) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    if r.error:
        shown = r.error if r.error.startswith("n/a") else "ERROR: " + r.error
        return [r.name] + ["-"] * (len(_COLUMNS) - 2) + [shown[:77]]
    recall = "-" if r.retrieval_found is None else ("yes" if r.retrieval_found else "no")
    return [
        r.name,
        f"{r.matched}/{r.new_tokens}",
        "-" if r.first_divergence is None else str(r.first_divergence),
        num(r.ref_margin, ".1e"),
        num(r.max_abs_dlogit, ".2e"),
        num(r.mean_kl, ".2e"),
        num(r.ppl, ".3f"),
        num(r.ppl_ref, ".3f"),
        recall,
        _tolerance(r),
        "yes" if r.passed else "NO",
    ]


def _tolerance(r: Result) -> str:
    if r.extra.get("gate") == "peer":  # relative to the ir-default peer on the same prompt
        return f"{r.tolerance:.2f} (peer)"
    return format(r.tolerance, ".0e") if r.tolerance else "report"


def table(results: list[Result]) -> str:
    rows = [list(_COLUMNS)] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(results: list[Result], command: str) -> str:
    rows = [list(_COLUMNS)] + [_row(r) for r in results]
    lines = ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    out = [f"# npuw-kv accuracy\n\nCommand: `{command}`\n", lines[0], "|" + "---|" * len(_COLUMNS)]
    out += lines[1:]
    out.append(
        "\nReference: openvino-genai CPU pipeline (greedy tokens) and the stateful IR (logits), "
        "both exact f32 with f32 KV. Both sides are teacher-forced on the reference tokens; "
        "`tokens` counts generated tokens equal before the first divergence; `ref margin` is, "
        "there, the reference's logit for its token minus its logit for the token chosen "
        "instead (an error that size flips the token: a small margin marks a near-tie); "
        "`recall` is the "
        "long-context retrieval check; `tol` is the max |dlogit| allowed (`report` = not gated; "
        "`(peer)`: device-default, held to the ir-default peer's error on the same prompt, "
        "|dlogit| and mean KL, instead of to the f32 tokens)."
    )
    return "\n".join(out) + "\n"


def write(results: list[Result], out_dir: Path, command: str) -> list[Path]:
    """Write results.json, report.md and accuracy.png into ``out_dir``; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = (
        out_dir / "results.json",
        out_dir / "report.md",
        out_dir / "accuracy.png",
    )
    json_path.write_text(json.dumps([r.as_dict() for r in results], indent=2, default=str))
    md_path.write_text(markdown(results, command))
    plot(results, png_path)
    return [json_path, md_path, png_path]


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if not r.error and not math.isnan(r.max_abs_dlogit)]
    names = [r.name for r in shown]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 0.6 * len(names) + 2), 6), sharex=True)
    top.bar(names, [r.matched / r.new_tokens for r in shown], color="tab:blue")
    top.set_ylabel("greedy agreement")
    top.set_ylim(0, 1.05)
    bottom.bar(names, [max(r.max_abs_dlogit, 1e-9) for r in shown], color="tab:orange")
    for i, r in enumerate(shown):
        if r.tolerance:
            bottom.hlines(r.tolerance, i - 0.4, i + 0.4, colors="red", linestyles="dashed")
    bottom.set_yscale("log")
    bottom.set_ylabel("max |Δlogit|")
    bottom.tick_params(axis="x", rotation=60)
    fig.suptitle("npuw-kv vs exact f32 reference (red dashes: tolerance)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
