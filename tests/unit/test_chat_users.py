"""The simulated chat users' verifiable rating: the answer read out of a chat reply, compared with the true rest of
the line, into a thumbs and a score."""

from __future__ import annotations

import pytest

from sim.chat_users import first_line, rate


def test_the_answer_is_the_replys_first_code_line_without_the_repeated_prompt() -> None:
    assert first_line("```python\nreturn a + b\n```", "def f(a, b):\n    ") == "return a + b"
    assert first_line("    x = compute(1)\nmore", "def g():\n    x = comp") == "ute(1)"
    assert first_line("", "x = ") == "" and first_line("```\n```", "x") == ""


@pytest.mark.parametrize(
    ("answer", "intended", "expected"),
    [
        ("(a, b)", "(a, b)", ("up", 5.0, 1.0)),
        ("(a, c)", "(a, b)", ("up", pytest.approx(1 + 4 * 4 / 6, abs=1e-3), 4 / 6)),
        ("(x)", "(a, b)", ("down", pytest.approx(1 + 4 / 6, abs=1e-3), 1 / 6)),
        ("", "(a, b)", ("down", 1.0, 0.0)),
    ],
)
def test_a_user_rates_an_answer_by_how_much_of_the_line_it_got_right(answer, intended, expected) -> None:
    thumbs, score, similarity = rate(answer, intended, up_at=0.5)
    assert (thumbs, score, similarity) == (expected[0], expected[1], pytest.approx(expected[2]))
    assert 1.0 <= score <= 5.0
