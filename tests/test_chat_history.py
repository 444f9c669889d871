"""Trimming a chat to fit the next turn (npuw_kv.api.chat_history), with a word count for tokens."""

from __future__ import annotations

import pytest

from npuw_kv.api.chat_history import fit_history

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


def _count(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"].split()) for m in messages)


SYSTEM = {"role": "system", "content": "be brief"}  # 2 words


def _chat(*words: int) -> list[dict[str, str]]:
    """Exchanges of a user turn and an answer of ``n`` words each."""
    out = [SYSTEM]
    for n in words:
        out += [{"role": "user", "content": "u " * n}, {"role": "assistant", "content": "a " * n}]
    return out


def test_a_chat_that_fits_is_left_alone() -> None:
    history = _chat(3, 3)
    assert fit_history(history, "one two", _count, 20) == (history, 0)


def test_old_exchanges_go_down_to_half_the_limit_and_the_system_message_stays() -> None:
    history = _chat(5, 5, 5, 1)  # 2 + 10 + 10 + 10 + 2 = 34 words, prompt 2 more
    kept, dropped = fit_history(history, "one two", _count, 30)
    # dropping one exchange would fit (26 <= 30), but only three get under half (6 <= 15)
    assert dropped == 3 and kept == [SYSTEM, *history[-2:]]


def test_when_half_is_out_of_reach_the_fewest_exchanges_go() -> None:
    history = _chat(8, 2, 2)  # 26 words; with an 11-word prompt even the system message and
    # the prompt alone (13) are over half the limit (12), and dropping the first exchange fits
    kept, dropped = fit_history(history, "w " * 11, _count, 24)
    assert dropped == 1 and kept == [SYSTEM, *history[3:]]


def test_a_prompt_too_long_even_alone_changes_nothing() -> None:
    history = _chat(2, 2)
    assert fit_history(history, "w " * 40, _count, 30) == (history, 0)
