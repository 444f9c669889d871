#!/usr/bin/env python3
"""Draw the shared KV buffer of one layer and the views the prefill and generate models use.

The static-shape path (``npuw_kv/runtime/static_runner.py``, ``runtime/binding.py``) keeps one
buffer ``[1, H, L-1, D]`` per layer for K and one for V, L = MAX_PROMPT_LEN + MIN_RESPONSE_LEN.
Each prefill chunk reads the slots before it (its past view) and writes its C new rows straight
into the next C slots (its present view); every generate step reads the whole buffer and writes
one slot.  All of them are views of the same memory, so nothing is copied when prefill ends.
The figure shows this along the slot axis for a small example (C = 4, MAX_PROMPT_LEN = 12,
MIN_RESPONSE_LEN = 5, a 10-token prompt, so 2 pad slots in front of the first chunk).

    python scripts/draw_kv_buffer.py                      # writes docs/kv_buffer.svg
    python scripts/draw_kv_buffer.py --png /tmp/kv.png    # and a PNG to look at

A figure is a *scenario*: a function returning the buffer's final contents and a list of rows
(one per model call) and separators.  Only ``static`` exists today; further ones (per-layer
lengths of a pyramid variant, the ring of a windowed layer) go into ``SCENARIOS`` and reuse
:func:`draw`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

# -- what a figure is made of ----------------------------------------------------------------

# Cell kinds of the buffer row and of the spans of a call row.  ``chunk0``, ``chunk1``, ... are
# the rows one prefill chunk wrote (the same colour in the buffer and in that chunk's present
# span), ``gen`` the rows generate steps wrote.
CHUNK_COLOURS = ("#f4a261", "#e76f51", "#d4a373", "#bc6c25")
STYLE: dict[str, dict[str, Any]] = {
    "empty": {"facecolor": "white", "edgecolor": "#999999"},
    "pad": {"facecolor": "#dddddd", "edgecolor": "#999999", "hatch": "////"},
    "gen": {"facecolor": "#2a9d8f", "edgecolor": "#1d6f65"},
    "past": {"facecolor": "#cfe2f3", "edgecolor": "#3d85c6"},
    "masked": {"facecolor": "#eef4fa", "edgecolor": "#3d85c6", "hatch": "////"},
    "scratch": {"facecolor": "white", "edgecolor": "#999999", "linestyle": "--"},
}


def style(kind: str) -> dict[str, Any]:
    if kind.startswith("chunk"):
        colour = CHUNK_COLOURS[int(kind[5:]) % len(CHUNK_COLOURS)]
        return {"facecolor": colour, "edgecolor": "#7a4a1a"}
    return STYLE[kind]


@dataclass(frozen=True)
class Span:
    """Slots ``[start, stop)`` drawn as one kind; ``text`` is written inside when it fits."""

    start: int
    stop: int
    kind: str
    text: str = ""


@dataclass(frozen=True)
class Row:
    """One model call: what it reads (past spans) and writes (present spans)."""

    title: str
    note: str  # right of the row: the views in slot numbers
    past: list[Span] = field(default_factory=list)
    present: list[Span] = field(default_factory=list)


@dataclass(frozen=True)
class Separator:
    text: str


@dataclass(frozen=True)
class Scenario:
    title: str
    slots: int  # the buffer's length along the slot axis
    buffer: list[Span]  # its contents at the end, for the top row
    rows: list[Row | Separator]
    footnotes: list[str]
    scratch: bool = False  # draw the scratch slot after the buffer


# -- scenarios -------------------------------------------------------------------------------


def static_chunk_loop(
    chunk: int = 4, max_prompt: int = 12, min_response: int = 5, prompt: int = 10, steps: int = 2
) -> Scenario:
    """The static-shape path: front-padded prefill chunks, then generate steps (plan.py)."""
    total = max_prompt + min_response  # L
    slots = total - 1  # the buffer: the L-th token's KV is never read, it goes to scratch
    padded = -(-prompt // chunk) * chunk  # P
    pad = padded - prompt
    chunks = padded // chunk
    buffer: list[Span] = []
    rows: list[Row | Separator] = []
    for k in range(chunks):
        start, stop = k * chunk, (k + 1) * chunk
        present = []
        if k == 0 and pad:
            present.append(Span(0, pad, "pad", "pad"))
        first = pad if k == 0 else start
        present.append(Span(first, stop, f"chunk{k}", f"t{first - pad}–t{stop - pad - 1}"))
        buffer.extend(present)
        past = []
        if k and pad:
            past.append(Span(0, pad, "masked"))
        if start > pad or (k and not pad):
            past.append(Span(pad if k else 0, start, "past", "past"))
        rows.append(
            Row(
                f"prefill chunk {k}",
                f"past [0, {start})\npresent [{start}, {stop})",
                past,
                present,
            )
        )
    rows.append(Separator("prefill → generate: the same buffer, 0 bytes copied"))
    for t in range(steps):
        slot = padded + t
        past = [
            Span(0, pad, "masked"),
            Span(pad, slot, "past", "past (live slots)"),
            Span(slot + 1, slots, "masked", "unwritten"),
        ]
        rows.append(
            Row(
                f"generate step {t}",
                f"past [0, L−1)\npresent [{slot}, {slot + 1})",
                [s for s in past if s.stop > s.start],
                [Span(slot, slot + 1, "gen", f"g{t}")],
            )
        )
        buffer.append(Span(slot, slot + 1, "gen", f"g{t}"))
    buffer.append(Span(padded + steps, slots, "empty", "free"))
    return Scenario(
        title=(
            "One layer's K buffer [1, H, L−1, D] (V alike) along its slot axis, "
            "L = MAX_PROMPT_LEN + MIN_RESPONSE_LEN\n"
            f"C = {chunk}, MAX_PROMPT_LEN = {max_prompt}, MIN_RESPONSE_LEN = {min_response}, "
            f"so L = {total} and {slots} slots; a {prompt}-token prompt, then {steps} generate "
            "steps"
        ),
        slots=slots,
        buffer=buffer,
        rows=rows,
        footnotes=[
            f"The prompt is padded at the front to a multiple of C ({pad} pad slots, masked for "
            "good), so its last token is the last row of the last chunk.",
            "Each call writes its present rows through an ROI view (ov.Tensor) of this buffer and "
            "reads its past in place (CPU: the whole buffer, sliced in the graph by the mask).",
            "NPU (two static models): the prefill's past view is fixed at [0, MAX_PROMPT_LEN − C)"
            " and the mask hides the slots not written yet.",
            "The L-th token's KV is never read: the last generate step writes it to scratch.",
        ],
        scratch=True,
    )


# More scenarios (a pyramid variant's per-layer lengths, a windowed layer's ring) go here.
SCENARIOS: dict[str, Callable[[], Scenario]] = {"static": static_chunk_loop}


# -- drawing ---------------------------------------------------------------------------------

UNIT_IN = 0.42  # one slot, in inches (the figure scales with the buffer's length)
ROW_H = 0.62  # height of a call row's bar; a row is 1.0 high
LEFT = 3.6  # slot units left of slot 0, for the row titles
NOTES = 5.8  # slot units right of the buffer (after the scratch slot), for the row notes
CHAR_W = 0.16  # width of one 8.5-point character, in slot units
FONT = {"bar": 8.5, "title": 10, "note": 8.5, "foot": 9, "head": 11}
HATCHED = ("pad", "masked")


def _bar(ax: plt.Axes, span: Span, y: float, height: float = ROW_H, z: int = 2) -> None:
    ax.add_patch(
        Rectangle(
            (span.start, y - height / 2),
            span.stop - span.start,
            height,
            linewidth=1.0,
            zorder=z,
            **style(span.kind),
        )
    )
    if not span.text or len(span.text) * CHAR_W + 0.2 > span.stop - span.start:
        return  # text only where it fits
    dark = span.kind.startswith("chunk") or span.kind == "gen"
    box = {"facecolor": "white", "edgecolor": "none", "pad": 0.8}
    ax.text(
        (span.start + span.stop) / 2,
        y,
        span.text,
        ha="center",
        va="center",
        fontsize=FONT["bar"],
        color="white" if dark else "#333333",
        zorder=z + 1,
        bbox=box if span.kind in HATCHED else None,
    )


def draw(scenario: Scenario) -> plt.Figure:
    n = scenario.slots
    right = n + (1.7 if scenario.scratch else 0.3)  # where the notes start
    x0, x1 = -LEFT, right + NOTES
    legend_rows, foot_h = 2, 0.5
    y_top, y_bottom = (
        1.15,
        -(len(scenario.rows) + 1.3 + 0.5 * legend_rows + foot_h * len(scenario.footnotes)),
    )
    head_in = 0.75  # the two title lines
    fig = plt.figure(figsize=(UNIT_IN * (x1 - x0), UNIT_IN * (y_top - y_bottom) + head_in))
    ax = fig.add_axes((0, 0, 1, (UNIT_IN * (y_top - y_bottom)) / fig.get_figheight()))
    ax.set_xlim(x0, x1)
    ax.set_ylim(y_bottom, y_top)
    ax.axis("off")
    fig.text(
        0.01,
        1 - 0.12 / fig.get_figheight(),
        scenario.title,
        fontsize=FONT["head"],
        ha="left",
        va="top",
        linespacing=1.4,
    )

    # the buffer: its final contents, slot numbers above
    for s in scenario.buffer:
        for slot in range(s.start, s.stop):  # a border around every slot
            _bar(ax, Span(slot, slot + 1, s.kind), 0, 0.8)
        _bar(ax, Span(s.start, s.stop, s.kind, s.text), 0, 0.8, z=3)
    for slot in range(n):
        ax.text(slot + 0.5, 0.5, str(slot), ha="center", va="bottom", fontsize=7.5, color="#555555")
    ax.text(-0.25, 0.7, "slot", ha="right", va="center", fontsize=8, color="#555555")
    if scenario.scratch:
        ax.add_patch(Rectangle((n + 0.4, -0.4), 0.9, 0.8, linewidth=1.0, **style("scratch")))
        ax.text(n + 0.85, 0.5, "scratch", ha="center", va="bottom", fontsize=7.5, color="#555555")
    ax.text(
        -0.25,
        0,
        "shared buffer",
        ha="right",
        va="center",
        fontsize=FONT["title"],
        fontweight="bold",
    )
    ax.text(
        right,
        0,
        "one allocation;\nevery row below\nis a view of it",
        ha="left",
        va="center",
        fontsize=FONT["note"],
        color="#333333",
        linespacing=1.1,
    )

    # one row per model call, on the same slot axis
    y = -1.25
    for row in scenario.rows:
        if isinstance(row, Separator):
            ax.plot(
                [x0 + 0.2, x1 - 0.2],
                [y + 0.1, y + 0.1],
                color="#2a9d8f",
                linewidth=1.2,
                linestyle=(0, (4, 3)),
            )
            ax.text(
                n / 2,
                y + 0.1,
                f" {row.text} ",
                ha="center",
                va="center",
                fontsize=FONT["title"],
                fontweight="bold",
                color="#1d6f65",
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5},
            )
            y -= 0.85
            continue
        for slot in range(n):  # the slot grid: every row lies on the same memory
            ax.add_patch(
                Rectangle(
                    (slot, y - ROW_H / 2),
                    1,
                    ROW_H,
                    facecolor="none",
                    edgecolor="#e2e2e2",
                    linewidth=0.6,
                    zorder=1,
                )
            )
        for s in row.past:
            _bar(ax, s, y)
        for s in row.present:
            _bar(ax, s, y, z=4)
        ax.text(-0.25, y, row.title, ha="right", va="center", fontsize=FONT["title"])
        ax.text(
            right,
            y,
            row.note,
            ha="left",
            va="center",
            fontsize=FONT["note"],
            family="monospace",
            color="#333333",
        )
        y -= 1.0

    handles = [
        Patch(**style("past"), label="past view (read)"),
        Patch(**style("masked"), label="in the view, masked"),
        Patch(**style("pad"), label="front padding (masked)"),
        Patch(**style("chunk0"), label="present: a chunk's C rows (written)"),
        Patch(**style("gen"), label="present: a generate step's row"),
    ]
    ax.legend(
        handles=handles,
        loc="upper left",
        ncol=3,
        fontsize=FONT["foot"],
        frameon=False,
        bbox_to_anchor=(0.01, (y + 0.35 - y_bottom) / (y_top - y_bottom)),
        handlelength=2.4,
        columnspacing=1.6,
    )
    y -= 0.5 * legend_rows + 0.35
    for note in scenario.footnotes:
        ax.text(
            x0 + 0.25,
            y,
            "• " + note,
            ha="left",
            va="center",
            fontsize=FONT["foot"],
            color="#333333",
        )
        y -= foot_h
    return fig


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="static")
    parser.add_argument("--out", type=Path, default=root / "docs" / "kv_buffer.svg")
    parser.add_argument("--png", type=Path, default=None, help="also write a PNG here")
    args = parser.parse_args()
    plt.rcParams["svg.hashsalt"] = "npuw-kv"  # stable ids: the SVG only changes with the figure
    fig = draw(SCENARIOS[args.scenario]())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, format="svg", metadata={"Date": None})
    print(f"wrote {args.out}")
    if args.png is not None:
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
