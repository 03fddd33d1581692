"""The ``session`` prompt set: multi-turn sequences over pinned standard-library sources."""

import sys

import pytest

from xpuspec.bench import prompts


def test_sessions_are_pinned_and_whole():
    sessions = prompts.sessions()
    assert len(sessions) == 12 and {s.kind for s in sessions} == {"edit", "transform", "qa"}
    if sys.version_info[:2] == (3, 11):
        assert all(s.pinned for s in sessions)
    flat = prompts.full_set("session")
    assert len(flat) == 12 * prompts.SESSION_TURNS and flat == prompts.full_set("session")
    assert prompts.parse_prompt_spec("session:4") == {"session": 4}
    assert prompts.parse_prompt_spec("4") == {"code": 4, "prose": 4, "edit": 4}  # bare counts: the other sets
    chosen = prompts.select({"session": 4})["session"]  # two whole sessions, 3 turns each
    assert chosen == prompts.session_prompts([sessions[0], sessions[6]])
    assert prompts.fingerprint({"session": chosen})["sets"]["session"]["count"] == 6


def test_later_turns_build_on_earlier_answers():
    edit, transform, qa = prompts.sessions()[:3]
    rewritten = "def rgb_to_hls_v2(r, g, b):\n    return r, g, b\n```\n\nThe function was renamed."
    second = edit.prompt(1, [rewritten])
    assert "def rgb_to_hls_v2(r, g, b):\n    return r, g, b\n```" in second and "renamed." not in second
    assert "rename the parameter `r` to `r_in`" in second and second.endswith("```python\n")
    assert edit.source in edit.prompt(1)  # without the answer: the pinned source again
    assert "rename the variable `i` to `i_value`" in transform.prompt(1)
    third = qa.prompt(2, [" It repeats a block.", " The for statement is used to iterate."])
    assert third.startswith(prompts._QA_TEMPLATE.format(document=qa.source))
    assert "Answer: It repeats a block.\n\nQuestion: Quote" in third and third.endswith(
        prompts.SESSION_QUESTIONS[2] + "\nAnswer:")
    with pytest.raises(ValueError):
        qa.prompt(1, ["a", "b"])
    with pytest.raises(ValueError):
        qa.prompt(3)
