"""The cost model's memory across requests: stop probing speculation that keeps measuring slower.

Within a request the cost model (:mod:`xpuspec.speculative.costmodel`) switches a draft model off
once it measures slower than plain decoding, but each new request pays its probe again: a few
speculative rounds, and the draft's prefill. Measured on SmolLM2 int8 with the int4 self-draft
(64 new tokens): 31 tokens/s against 49 plain, although speculation was off after about 6 tokens.
So after two requests in a row whose speculation the cost model switched off, the next requests
decode plainly, probing again after 1, 2, 4, ... up to :data:`MAX_SKIPPED` skipped requests; a probe
in which speculation stays on resets the count. Where the last two failures found that even a full accept
would not pay (a draft as slow as the target: an INT4 copy of an INT8 model on a CPU without VNNI),
the acceptance of later prompts cannot change that, and :data:`MAX_SKIPPED` requests are skipped at once.

The memory also keeps each drafter's acceptance per draft position over its earlier requests (each new
request halves the weight of the ones before, :data:`DECAY`): the prior from which the next request's
cost model starts (:class:`xpuspec.speculative.costmodel.CostModel`). A pair's acceptance is a property
of the pair more than of one prompt, and with a fixed prior three rejected opening rounds were enough to
switch a draft model off that the rest of the request would have used well. A hybrid's counts include its
prompt-lookup rounds (the cost model counts every round with drafts). The generate call keys the memory by
drafter and by greedy or sampling, so the two keep their own failures, skips and rates.
"""

from dataclasses import dataclass
from typing import Dict, Hashable, Optional

from .costmodel import AcceptanceCounts

#: Requests in a row that must measure speculation slower before later requests skip it.
FAILURES_BEFORE_SKIPPING = 2
#: The most requests skipped between two probes.
MAX_SKIPPED = 16
#: The weight each new request leaves to the acceptance counts of the requests before it.
DECAY = 0.5


@dataclass
class _Record:
    failures: int = 0  # consecutive requests whose speculation the cost model switched off
    skipped: int = 0   # requests decoded plainly since the last probe
    cannot_pay: int = 0  # consecutive failures that found that even a full accept would not pay
    acceptance: Optional[AcceptanceCounts] = None  # per draft position, earlier requests weighed down


class SpeculationMemory:
    """Per drafter (any hashable key), whether the next request should speculate."""

    def __init__(self):
        self._records: Dict[Hashable, _Record] = {}

    def should_speculate(self, key: Hashable) -> bool:
        """True to speculate on this request (a probe); False to decode it plainly (counted as skipped)."""
        record = self._records.setdefault(key, _Record())
        if record.failures < FAILURES_BEFORE_SKIPPING:
            return True
        skips = (MAX_SKIPPED if record.cannot_pay >= FAILURES_BEFORE_SKIPPING
                 else 2 ** (record.failures - FAILURES_BEFORE_SKIPPING))
        if record.skipped < min(skips, MAX_SKIPPED):
            record.skipped += 1
            return False
        record.skipped = 0
        return True

    def acceptance(self, key: Hashable) -> Optional[AcceptanceCounts]:
        """The drafter's rounds judged and accepted per draft position over its earlier requests, or ``None``."""
        record = self._records.get(key)
        if record is None or record.acceptance is None:
            return None
        return record.acceptance.copy()

    def record(self, key: Hashable, switched_off: bool, cannot_pay: bool = False,
               acceptance: Optional[AcceptanceCounts] = None) -> None:
        """Note the outcome of a request that speculated: ``switched_off`` by the cost model or not,
        whether it found that even a full accept would not pay (``cannot_pay``), and its rounds judged and
        accepted per draft position (``acceptance``; ``None``: nothing to add)."""
        record = self._records.setdefault(key, _Record())
        record.failures = record.failures + 1 if switched_off else 0
        record.cannot_pay = record.cannot_pay + 1 if switched_off and cannot_pay else 0
        if acceptance is not None and acceptance.judged:
            record.acceptance = _added(record.acceptance, acceptance)


def _added(earlier: Optional[AcceptanceCounts], new: AcceptanceCounts) -> AcceptanceCounts:
    """``new`` plus ``earlier`` weighed by :data:`DECAY`, position by position."""
    if earlier is None:
        return new.copy()

    def add(old, now):
        size = max(len(old), len(now))
        return [DECAY * (old[i] if i < len(old) else 0.0) + (now[i] if i < len(now) else 0.0) for i in range(size)]

    return AcceptanceCounts(add(earlier.judged, new.judged), add(earlier.accepted, new.accepted))
