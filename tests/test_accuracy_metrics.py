"""The accuracy metrics on hand-made numbers (no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from npuw_kv.tools.accuracy import metrics
from npuw_kv.tools.accuracy.report import markdown, table
from npuw_kv.tools.accuracy.result import Result

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


def test_first_divergence():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert metrics.first_divergence([9], [1]) == 0


def test_ref_margin_is_the_reference_lead_over_the_token_chosen_instead():
    ref = np.array([[1.0, 3.0, 2.5, 0.0], [4.0, 0.0, 1.0, 2.0]])
    assert metrics.lead_at(ref, [1, 0], [1, 3], 1) == pytest.approx(2.0)  # not the runner-up's 1.0
    assert metrics.lead_at(ref, [1, 0], [2, 0], 0) == pytest.approx(0.5)
    assert math.isnan(metrics.lead_at(ref, [1, 0], [1, 0], None))  # no divergence, no margin


def test_kl_is_zero_for_equal_and_shift_invariant():
    logits = np.array([[1.0, 2.0, 3.0], [0.5, 0.5, 0.0]])
    assert np.allclose(metrics.kl_divergence(logits, logits), 0)
    assert np.allclose(metrics.kl_divergence(logits, logits + 7.0), 0)  # softmax ignores shifts
    p, q = np.array([[0.0, 0.0]]), np.array([[math.log(3.0), 0.0]])  # [1/2,1/2] vs [3/4,1/4]
    expected = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert metrics.kl_divergence(p, q)[0] == pytest.approx(expected)


def test_perplexity_of_uniform_and_certain_predictions():
    uniform = np.zeros((4, 10))
    assert metrics.perplexity([metrics.nll(uniform, np.array([1, 2, 3, 4]))]) == pytest.approx(10.0)
    certain = np.full((2, 5), -1e4)
    certain[0, 3] = certain[1, 1] = 0.0
    assert metrics.perplexity([metrics.nll(certain, np.array([3, 1]))]) == pytest.approx(1.0)
    assert math.isnan(metrics.perplexity([metrics.nll(np.zeros((0, 3)), np.zeros(0, int))]))


def test_perplexity_of_a_prompt_in_pieces_equals_the_whole():
    """The accuracy tool scores long prompts a chunk at a time (a 262k vocabulary's 4k rows
    do not fit at once): the pieces must give the whole prompt's perplexity."""
    logits = np.random.default_rng(0).normal(size=(7, 11))
    targets = np.array([1, 5, 2, 9, 0, 10, 3])
    whole = metrics.perplexity([metrics.nll(logits, targets)])
    pieces = [metrics.nll(logits[i : i + 3], targets[i : i + 3]) for i in range(0, 7, 3)]
    assert metrics.perplexity(pieces) == pytest.approx(whole, rel=1e-12)
    assert whole != pytest.approx(metrics.perplexity(pieces[:1]))


def test_report_rows_show_failures_and_errors():
    ok = Result(
        1024,
        "CPU",
        "exact",
        256,
        64,
        matched=64,
        max_abs_dlogit=5e-5,
        mean_kl=1e-12,
        ppl=3.1,
        ppl_ref=3.1,
        retrieval_found=True,
        tolerance=1e-3,
        passed=True,
    )
    bad = Result(
        1024,
        "NPU",
        "exact",
        256,
        64,
        matched=10,
        first_divergence=10,
        ref_margin=0.0123,
        max_abs_dlogit=0.5,
        tolerance=0.1,
        passed=False,
    )
    err = Result(4096, "CPU", "nope", 256, 64, error="unknown mode 'nope'")
    text = table([ok, bad, err])
    assert "CPU/exact/C256/1024" in text and "64/64" in text and "5.00e-05" in text
    assert "10/64" in text and "1.2e-02" in text and " NO" in text
    assert "ERROR: unknown mode 'nope'" in text
    md = markdown([ok, bad], "npuw-kv accuracy")
    assert md.count("\n|") == 4 and "`npuw-kv accuracy`" in md
