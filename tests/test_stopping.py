"""Stop strings over streamed text (xpuspec.stopping) and incremental detokenization (xpuspec.detokenize)."""

import random

import pytest

from xpuspec.detokenize import IncrementalDetokenizer
from xpuspec.stopping import StopStringMatcher


def run(stop, pieces):
    """(shown text, the final check) after feeding ``pieces`` and flushing if no stop string appeared."""
    matcher, shown, check = StopStringMatcher(stop), [], None
    for piece in pieces:
        check = matcher.feed(piece)
        shown.append(check.text)
        if check.stopped:
            break
    if not matcher.stopped:
        shown.append(matcher.flush())
    return "".join(shown), check


def splits(text, rng, cuts):
    points = sorted(rng.sample(range(1, len(text)), min(cuts, len(text) - 1)))
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)])]


@pytest.mark.parametrize("stop, text, output, found", [
    (["\n\n"], "def f():\n    return 1\n\nprint(f())", "def f():\n    return 1", "\n\n"),
    (["END"], "no stop here", "no stop here", None),
    (["abc", "b"], "xxabc", "xxa", "b"),  # "b" completes first
    (["bc", "abc"], "xxabc", "xx", "abc"),  # both complete at one character: the longer
    (["aab"], "aaab", "a", "aab"),  # a partial match that fails, then one a character later
    (["<|im_end|>"], "Paris.<|im_end", "Paris.<|im_end", None),  # never completed: all of it at the end
    (["ab"], "a", "a", None),
])
def test_cut_is_the_same_for_every_split(stop, text, output, found):
    rng = random.Random(0)
    for trial in range(60):
        pieces = [text] if trial == 0 else list(text) if trial == 1 else splits(text, rng, rng.randint(1, 6))
        shown, check = run(stop, pieces)
        assert shown == output, pieces
        assert (check.stop_string if check and check.stopped else None) == found
        if found:
            assert text[check.start:check.end] == found and check.start == len(output)


def test_text_that_may_start_a_stop_string_is_held_back():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go S").text == "go "
    assert matcher.feed("T").text == ""
    assert matcher.feed("x").text == "STx"  # no longer a start of STOP
    assert matcher.feed("ST").text == ""
    check = matcher.feed("OP and more")
    assert check.stopped and check.text == "" and (check.start, check.end) == (6, 10)
    assert matcher.feed("later").text == "" and matcher.flush() == ""


def test_without_stop_strings_everything_passes_at_once():
    matcher = StopStringMatcher([])
    assert [matcher.feed(p).text for p in ("a", "bc")] == ["a", "bc"] and matcher.flush() == ""


@pytest.mark.parametrize("bad", [[""], [None], [3]])
def test_invalid_stop_strings_are_refused(bad):
    with pytest.raises(ValueError, match="non-empty strings"):
        StopStringMatcher(bad)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from xpuspec import AutoTokenizer

    return AutoTokenizer.from_pretrained("smollm2-135m-instruct")


@pytest.mark.parametrize("text", [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Grüße aus Köln — 東京タワー 🚀 naïve café",
    "<|im_start|>assistant\nHi!<|im_end|>",
])
def test_pieces_join_to_the_whole_decode(smollm2_tokenizer, text):
    ids = smollm2_tokenizer(text).input_ids
    rng = random.Random(1)
    for trial in range(10):
        detok, pieces, i = IncrementalDetokenizer(smollm2_tokenizer), [], 0
        while i < len(ids):  # one token at a time, then blocks of up to 5 (accepted drafts)
            n = 1 if trial == 0 else rng.randint(1, 5)
            pieces.append(detok.add(ids[i:i + n]))
            i += n
        pieces.append(detok.flush())
        assert "".join(pieces) == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in p for p in pieces)


def test_a_stop_string_inside_a_block_of_tokens_cuts_exactly(smollm2_tokenizer):
    text = "x = 1\ny = 2\n# done\nz = 3"
    ids = smollm2_tokenizer(text).input_ids
    for block in (1, 3, len(ids)):
        detok, matcher, shown = IncrementalDetokenizer(smollm2_tokenizer), StopStringMatcher(["# do"]), ""
        for i in range(0, len(ids), block):
            check = matcher.feed(detok.add(ids[i:i + block]))
            shown += check.text
            if check.stopped:
                break
        assert check.stopped and shown == "x = 1\ny = 2\n"
