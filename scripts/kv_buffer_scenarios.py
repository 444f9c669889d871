#!/usr/bin/env python3
"""The scenarios ``draw_kv_buffer.py`` draws: what one layer's KV buffer holds and which views
each model call reads and writes, computed with the runtime's own rules.

* ``static``: the static-shape path's front-padded chunk loop, then generate steps (plan.py);
* ``pyramid``: the same with prefill models by past length (``StaticShapes.prefill_pasts``),
  each chunk on the smallest past that holds the slots before it (runtime/ladder.py);
* ``ring``: a sliding-window layer's ring (model/ring.py), its slots and masks as
  runtime/rings.py computes them.

Run on its own it checks every scenario (each span inside the buffer, each chunk's rows written
once) and lists them: ``python scripts/kv_buffer_scenarios.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # npuw_kv from a checkout

from npuw_kv.kv.shapes import StaticShapes
from npuw_kv.kv.slots import ring_slots
from npuw_kv.runtime.static.plan import PromptPlan  # noqa: E402
from npuw_kv.runtime.static.rings import held_slots, window_mask  # noqa: E402

# Cell kinds of the buffer row and of the spans of a call row: ``chunk0``, ``chunk1``, ... are
# the rows one prefill chunk wrote (the same colour in the buffer and in that chunk's present
# span), ``gen`` the rows generate steps wrote; then pad, past, masked, empty, scratch.


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
    slot_label: str = "slot"


def _front_padded(prompt: int, chunk: int) -> tuple[int, int]:
    """(padded length, pad) of a fresh prompt, as plan.py lays it out."""
    plan = PromptPlan(prompt, chunk)
    return plan.padded_len, plan.pad


def _chunk_present(k: int, chunk: int, pad: int) -> list[Span]:
    start, stop = k * chunk, (k + 1) * chunk
    spans = [Span(0, pad, "pad", "pad")] if k == 0 and pad else []
    first = pad if k == 0 else start
    return [*spans, Span(first, stop, f"chunk{k}", f"t{first - pad}–t{stop - pad - 1}")]


def _written_past(start: int, pad: int) -> list[Span]:
    """The slots before ``start`` as a chunk's mask sees them: the pad masked, the rest read."""
    spans = [Span(0, min(pad, start), "masked")] if pad and start else []
    if start > pad:
        spans.append(Span(pad, start, "past", "past"))
    return spans


def _generate_rows(padded: int, pad: int, slots: int, steps: int) -> tuple[list[Row], list[Span]]:
    rows, written = [], []
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
        written.append(Span(slot, slot + 1, "gen", f"g{t}"))
    return rows, written


def _chunk_loop(
    chunk: int,
    prompt: int,
    slots: int,
    steps: int,
    view: Callable[[int, int], tuple[str, list[Span]]],
) -> tuple[list[Span], list[Row | Separator]]:
    """The front-padded chunks, then generate steps: the buffer's final contents and the rows.
    ``view(start, stop)``: a chunk's note and past spans."""
    padded, pad = _front_padded(prompt, chunk)
    buffer: list[Span] = []
    rows: list[Row | Separator] = []
    for k in range(padded // chunk):
        start, stop = k * chunk, (k + 1) * chunk
        present = _chunk_present(k, chunk, pad)
        buffer.extend(present)
        note, past = view(start, stop)
        rows.append(Row(f"prefill chunk {k}", note, past, present))
    rows.append(Separator("prefill → generate: the same buffer, 0 bytes copied"))
    generate, written = _generate_rows(padded, pad, slots, steps)
    rows += generate
    buffer += [*written, Span(padded + steps, slots, "empty", "free")]
    return buffer, rows


def static_chunk_loop(
    chunk: int = 4, max_prompt: int = 12, min_response: int = 5, prompt: int = 10, steps: int = 2
) -> Scenario:
    """The static-shape path: front-padded prefill chunks, then generate steps (plan.py)."""
    total = max_prompt + min_response  # L
    slots = total - 1  # the buffer: the L-th token's KV is never read, it goes to scratch
    _, pad = _front_padded(prompt, chunk)
    buffer, rows = _chunk_loop(
        chunk,
        prompt,
        slots,
        steps,
        lambda start, stop: (
            f"past [0, {start})\npresent [{start}, {stop})",
            _written_past(start, pad),
        ),
    )
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


def pyramid_prefill(
    chunk: int = 4, max_prompt: int = 24, min_response: int = 4, prompt: int = 22, steps: int = 1
) -> Scenario:
    """The NPU path's prefill models by past length (``prefill_attention="pyramid"``)."""
    total = max_prompt + min_response
    shapes = StaticShapes(chunk, max_prompt, total, pyramid=True)
    lean = StaticShapes(  # as prefill_attention / generate_pyramid "auto" shape them
        chunk,
        max_prompt,
        total,
        pyramid=True,
        generate_variants=True,
        lean_pyramid=True,
        lean_generate=True,
    )
    pasts, slots = shapes.prefill_pasts, shapes.generate_past
    padded, pad = _front_padded(prompt, chunk)

    def view(start: int, stop: int) -> tuple[str, list[Span]]:
        past = next(p for p in pasts if p >= start)  # as runtime/ladder.py picks
        spans = _written_past(start, pad)
        if past > start:
            spans.append(Span(start, past, "masked", "not written"))
        return f"model past {past}: [0, {past})\npresent [{start}, {stop})", spans

    buffer, rows = _chunk_loop(chunk, prompt, slots, steps, view)
    return Scenario(
        title=(
            "The pyramid: prefill models by past length, each reading a view of the same buffer\n"
            f"C = {chunk}, MAX_PROMPT_LEN = {max_prompt}, MIN_RESPONSE_LEN = {min_response}: "
            f"prefill models of past {', '.join(map(str, pasts))}; a {prompt}-token prompt"
        ),
        slots=slots,
        buffer=buffer,
        rows=rows,
        footnotes=[
            "Chunk k runs on the smallest model whose past holds the slots before it, so its "
            "attention reads at most twice the slots it needs (the static path: all of "
            f"[0, {shapes.prefill_past}) for every chunk).",
            *_overlap_note(pasts, chunk, padded),
            "Every model's past is a view [0, past) of the same buffer: moving between them "
            "copies nothing. prefill_attention='auto' keeps "
            f"{', '.join(map(str, lean.prefill_pasts))} (each static model costs its own "
            "compiled memory).",
            "Generate models by KV length (NPUW_LLM_GENERATE_PYRAMID: room for 1024, 2048, … "
            "prompt tokens) read views [0, n) of it the same way.",
        ],
    )


def _overlap_note(pasts: tuple[int, ...], chunk: int, padded: int) -> list[str]:
    """Where a model's past view reaches over the rows its own chunk writes, say why that is
    safe (the first such chunk as the example)."""
    for start in range(0, padded, chunk):
        past = next(p for p in pasts if p >= start)
        if past > start:
            return [
                f"A model's past may reach over the rows its chunk writes (past [0, {past}), "
                f"present [{start}, {start + chunk})): the mask hides them, so no request "
                "reads what it writes."
            ]
    return []


def _tokens(held: int, pad: int, padded: int, chunk: int) -> tuple[str, str]:
    """The kind and label of a ring slot holding token slot ``held``."""
    if held < 0:
        return "empty", ""
    if held < pad:
        return "pad", "pad"
    if held < padded:
        return f"chunk{held // chunk}", f"t{held - pad}"
    return "gen", f"g{held - padded}"


def ring_window(chunk: int = 4, window: int = 5, prompt: int = 14, steps: int = 2) -> Scenario:
    """A sliding-window layer's KV in a ring (``window_kv``): token slot s in ring slot s mod R."""
    ring = ring_slots(window, chunk)
    padded, pad = _front_padded(prompt, chunk)
    rows: list[Row | Separator] = []

    def call(title: str, start: int, tokens: int, present: list[Span]) -> Row:
        mask = window_mask(start, tokens, pad, window, ring)[0, 0]
        read = (mask[:, :ring] == 0).any(axis=0)  # a ring slot some query of the call reads
        held = held_slots(start, ring)
        past = [
            Span(j, j + 1, "past" if read[j] else "masked", _tokens(held[j], pad, padded, chunk)[1])
            for j in range(ring)
            if held[j] >= 0
        ]
        first = start % ring
        note = f"token slots [{start}, {start + tokens})\n→ ring [{first}, {first + tokens})"
        return Row(title, note, past, present)

    for k in range(padded // chunk):
        start = k * chunk
        present = [
            Span(s.start % ring, (s.start % ring) + s.stop - s.start, s.kind, s.text)
            for s in _chunk_present(k, chunk, pad)
        ]
        rows.append(call(f"prefill chunk {k}", start, chunk, present))
    rows.append(Separator("prefill → generate: the same ring"))
    for t in range(steps):
        slot = padded + t
        present = [Span(slot % ring, slot % ring + 1, "gen", f"g{t}")]
        rows.append(call(f"generate step {t}", slot, 1, present))
    held = held_slots(padded + steps, ring)
    buffer = [Span(j, j + 1, *_tokens(held[j], pad, padded, chunk)) for j in range(ring)]
    return Scenario(
        title=(
            "A sliding-window layer's KV in a ring (window_kv): the window plus one chunk, "
            "written circularly\n"
            f"W = {window}, C = {chunk}: R = ceil((W + C − 1) / C)·C = {ring} ring slots, token "
            f"slot s in ring slot s mod R; a {prompt}-token prompt, {steps} generate steps"
        ),
        slots=ring,
        buffer=buffer,
        rows=rows,
        footnotes=[
            "Every call reads the whole ring (dense: bound in place) and writes at s mod R; its "
            "mask input window_mask.W hides what is out of each query's window (hatched).",
            "A call overwrites only slots no query of it can see any more. The full-attention "
            "layers keep the whole buffer of the first figure.",
        ],
        slot_label="ring slot",
    )


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "static": static_chunk_loop,
    "pyramid": pyramid_prefill,
    "ring": ring_window,
}


def check(scenario: Scenario) -> None:
    """Every span inside the buffer; the chunks' present rows tile the prompt's slots once."""
    spans = [*scenario.buffer]
    for row in scenario.rows:
        if isinstance(row, Row):
            spans += row.past + row.present
    for s in spans:
        if not 0 <= s.start < s.stop <= scenario.slots:
            raise ValueError(f"{scenario.title.splitlines()[0]}: span {s} outside the buffer")
    written = sorted(
        (s.start, s.stop) for row in scenario.rows if isinstance(row, Row) for s in row.present
    )
    if scenario.slot_label == "slot":  # a ring rewrites its slots; a buffer each slot once
        for (_, stop), (start, _) in zip(written, written[1:], strict=False):
            if start < stop:
                raise ValueError(f"slot {start} written twice")


def main() -> None:
    for name, make in SCENARIOS.items():
        scenario = make()
        check(scenario)
        calls = sum(isinstance(r, Row) for r in scenario.rows)
        print(f"{name}: {scenario.slots} {scenario.slot_label}s, {calls} calls, checked")


if __name__ == "__main__":
    main()
