"""Simulated users: the verdict rule, a seeded population, and cursor sites from files never trained on."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from data_contracts import corpus
from sim.tab_sites import cursor_sites, site_files
from sim.users import SimUsersConfig, population, verdict


@pytest.mark.parametrize(
    "suggestion, intended, min_chars, expected",
    [
        ("", "return x", 3, (None, 0)),  # nothing shown: no feedback
        ("ret", "return x", 3, ("accepted", 3)),  # a prefix, long enough
        ("re", "return x", 3, ("rejected", 0)),  # a prefix, too short to be worth it
        ("return x", "return x", 3, ("accepted", 8)),  # the whole rest of the line
        ("return y", "return x", 3, ("partial", 7)),  # kept up to the first wrong character
        ("return x\n    y", "return x", 3, ("partial", 8)),  # ran over the line: the line is kept
        ("rx", "return x", 1, ("partial", 1)),
        ("xyz", "return x", 3, ("rejected", 0)),
    ],
)
def test_verdict_follows_the_intended_text_only(suggestion, intended, min_chars, expected):
    assert verdict(suggestion, intended, min_chars) == expected


def test_population_is_seeded_and_varied():
    cfg = SimUsersConfig(users=50, seed=3)
    a, b = population(cfg), population(cfg)
    assert a == b and len({u.user_id for u in a}) == 50
    assert {u.min_chars for u in a} <= set(range(3, 7)) and len({u.min_chars for u in a}) > 1
    assert all(0.2 <= u.feedback_delay_s <= 2.0 for u in a)
    assert population(cfg.model_copy(update={"seed": 4})) != a


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("min_chars", (0, 3), "min_chars must start at >= 1"),
        ("think_s", (1.0, 0.5), "need 0 <= low <= high"),
    ],
)
def test_bad_user_ranges_are_refused(field, value, message):
    with pytest.raises(ValidationError, match=message):
        SimUsersConfig(**{field: value})


def test_traffic_and_eval_files_are_disjoint_held_out_files():
    root, traffic = site_files("traffic", 0.1)
    _, evaluation = site_files("eval", 0.1)
    train, heldout = corpus.split_stdlib(0.1, root)
    assert traffic and evaluation and not set(traffic) & set(evaluation)
    assert set(traffic) | set(evaluation) == set(heldout)  # never the pretraining files
    assert not set(traffic) & set(train)


def test_cursor_sites_are_word_ends_mid_line_and_deterministic(tmp_path):
    (tmp_path / "a.py").write_text("def add(a, b):\n    return a + b\n\n\nx = add(1, 2)\n")
    files = [tmp_path / "a.py"]
    sites = cursor_sites(tmp_path, files, 20, seed=5)
    assert sites == cursor_sites(tmp_path, files, 20, seed=5)
    text = (tmp_path / "a.py").read_text()
    for s in sites:
        assert text[: s.offset].endswith(s.prompt) and (s.prompt[-1].isalnum() or s.prompt[-1] == "_")
        assert not (s.intended[0].isalnum() or s.intended[0] == "_")
        assert s.intended and "\n" not in s.intended and text[s.offset :].startswith(s.intended)


def test_a_code_dir_without_code_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        site_files("traffic", 0.1, code_dir=tmp_path / "missing")
    with pytest.raises(ValueError, match="no traffic files"):
        site_files("traffic", 0.1, code_dir=tmp_path)


def test_prompts_fit_the_context_in_bytes():
    from sim.tab_sites import tail_bytes

    assert tail_bytes("abcdef", 4) == "cdef"
    assert tail_bytes("xé€", 5) == "é€" and len("é€".encode()) == 5  # never half a character
    assert tail_bytes("x€", 2) == ""
