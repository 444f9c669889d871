"""The ring arithmetic of sliding-window layers on the static path (runtime/rings.py,
model/ring.py), checked against a token-by-token simulation of the ring."""

from __future__ import annotations

import numpy as np
import pytest

from npuw_kv.kv.slots import plan_rings, ring_segments, ring_slots
from npuw_kv.runtime.static.rings import ring_keeps, window_mask

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


def test_ring_is_window_plus_chunk_in_whole_chunks():
    assert ring_slots(512, 256) == 768
    assert ring_slots(512, 128) == 640
    assert ring_slots(8, 16) == 32
    assert ring_slots(16, 16) == 32
    # a ring as long as the cache gains nothing: that window keeps the whole past
    assert plan_rings((512, None, 512), 256, 4223) == ((512, 768),)
    assert plan_rings((512, None), 256, 768) == ()
    assert plan_rings((None, None), 256, 4223) == ()


@pytest.mark.parametrize(
    ("start", "stop", "ring", "want"),
    [
        (0, 16, 32, [(0, 16, 0)]),
        (40, 44, 32, [(8, 12, 0)]),
        (28, 36, 32, [(28, 32, 0), (0, 4, 4)]),
        (64, 96, 32, [(0, 32, 0)]),
    ],
)
def test_ring_segments(start, stop, ring, want):
    assert ring_segments(start, stop, ring) == want


def test_ring_segments_refuse_more_than_a_ring():
    with pytest.raises(ValueError, match="do not fit"):
        ring_segments(0, 33, 32)


def _simulate(first: int, writes: list[tuple[int, int]], ring: int) -> np.ndarray:
    """The token slot each ring slot holds after ``writes`` ([a, b) token slots), -1: none."""
    held = np.full(ring, -1)
    for a, b in writes:
        for t in range(a, b):
            held[t % ring] = t
    return held


@pytest.mark.parametrize("first", [0, 5, 13])
@pytest.mark.parametrize(("window", "chunk"), [(8, 16), (16, 16), (20, 8), (7, 4)])
def test_window_mask_matches_a_simulated_ring(first, window, chunk):
    """Every chunk of a prompt and then generate steps: the mask lets a query read exactly
    the slots of its window that the simulated ring holds, and its own chunk's causal part."""
    ring = ring_slots(window, chunk)
    writes = [(a, a + chunk) for a in range(0, 4 * chunk, chunk)]
    writes += [(t, t + 1) for t in range(4 * chunk, 4 * chunk + 2 * ring)]
    for k, (a, b) in enumerate(writes):
        held = _simulate(first, writes[:k], ring)
        mask = window_mask(a, b - a, first, window, ring)[0, 0]
        assert mask.shape == (b - a, ring + b - a)
        for i, q in enumerate(range(a, b)):
            reads = {int(held[j]) for j in range(ring) if mask[i, j] == 0}
            reads |= {a + j for j in range(b - a) if mask[i, ring + j] == 0}
            want = {t for t in range(max(first, q - window + 1), q + 1)} if q >= first else {q}
            assert reads == want, (a, q)


def test_ring_keeps_the_window_a_continuation_reads():
    # 100 token slots written into a ring of 32, window 8: slots 68.. are still there
    assert ring_keeps(0, resume=100, written_end=100, window=8, ring=32)
    assert ring_keeps(0, resume=75, written_end=100, window=8, ring=32)  # reads 68..74
    assert not ring_keeps(0, resume=74, written_end=100, window=8, ring=32)  # 67 is gone
    # a window reaching before the first token needs only the slots from it on
    assert ring_keeps(90, resume=92, written_end=100, window=8, ring=32)
