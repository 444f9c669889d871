#!/usr/bin/env python3
"""Draw the shared KV buffer of one layer and the views the prefill and generate models use.

The static-shape path (``npuw_kv/runtime/static/runner.py``, ``runtime/binding.py``) keeps one
buffer ``[1, H, L-1, D]`` per layer for K and one for V, L = MAX_PROMPT_LEN + MIN_RESPONSE_LEN.
Each prefill chunk reads the slots before it (its past view) and writes its C new rows straight
into the next C slots (its present view); every generate step reads the whole buffer and writes
one slot.  All of them are views of the same memory, so nothing is copied when prefill ends.
Three figures show this along the slot axis for small examples (``kv_buffer_scenarios.py``
computes them with the runtime's own rules): ``static`` (docs/kv_buffer.svg), the prefill
models by past length of the NPU path's ``pyramid`` (docs/kv_buffer_pyramid.svg) and a
sliding-window layer's ``ring`` (docs/kv_buffer_ring.svg).

    python scripts/draw_kv_buffer.py                          # writes all three into docs/
    python scripts/draw_kv_buffer.py --scenario ring --out /tmp/ring.svg --png /tmp/ring.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

try:
    import matplotlib
except ImportError:  # a plain install: the plots come with the accuracy extra
    sys.exit("draw_kv_buffer.py needs matplotlib: pip install 'npuw-kv[accuracy]'")

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_buffer_scenarios import SCENARIOS, Scenario, Separator, Span, check  # noqa: E402

# -- how each kind of cell looks -------------------------------------------------------------

# ``chunk0``, ``chunk1``, ...: the rows one prefill chunk wrote, the same colour in the buffer
# and in that chunk's present span; the other kinds are named in kv_buffer_scenarios.py.
CHUNK_COLOURS = ("#f4a261", "#e76f51", "#d4a373", "#bc6c25", "#e9c46a", "#a8763e")
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


# -- drawing ---------------------------------------------------------------------------------

UNIT_IN = 0.42  # one slot, in inches (the figure scales with the buffer's length)
ROW_H = 0.62  # height of a call row's bar; a row is 1.0 high
LEFT = 3.6  # slot units left of slot 0, for the row titles
NOTES = 5.8  # slot units right of the buffer (after the scratch slot), for the row notes
CHAR_W = 0.16  # width of one 8.5-point character, in slot units
MIN_WIDTH = 27.0  # slot units: room for the title and footnotes beside a short buffer
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
    x0, x1 = -LEFT, max(right + NOTES, MIN_WIDTH - LEFT)
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
    ax.text(-0.25, 0.7, scenario.slot_label, ha="right", va="center", fontsize=8, color="#555555")
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
    docs = Path(__file__).resolve().parent.parent / "docs"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenario", choices=sorted(SCENARIOS), default=None, help="one figure (default: all)"
    )
    parser.add_argument("--out", type=Path, default=None, help="where --scenario's SVG goes")
    parser.add_argument("--png", type=Path, default=None, help="also write a PNG of --scenario")
    args = parser.parse_args()
    if args.scenario is None and (args.out or args.png):
        parser.error("--out and --png name one figure: give --scenario too")
    plt.rcParams["svg.hashsalt"] = "npuw-kv"  # stable ids: the SVG only changes with the figure
    for name in [args.scenario] if args.scenario else list(SCENARIOS):
        scenario = SCENARIOS[name]()
        check(scenario)
        fig = draw(scenario)
        out = args.out or docs / ("kv_buffer.svg" if name == "static" else f"kv_buffer_{name}.svg")
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="svg", metadata={"Date": None})
        print(f"wrote {out}")
        if args.png is not None:
            fig.savefig(args.png, dpi=110)
            print(f"wrote {args.png}")
        plt.close(fig)


if __name__ == "__main__":
    main()
