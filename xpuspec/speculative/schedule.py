"""How many tokens a drafter is asked for per round (transformers' ``num_assistant_tokens`` and its schedule)."""

import numbers
from dataclasses import dataclass, replace

from ..errors import SpeculativeConfigError

#: The longest draft of prompt lookup alone. Lookup drafts cost no model step, so the policy cuts each round
#: to the length the target's measured verify costs favour (:mod:`xpuspec.speculative.policy`).
DEFAULT_LOOKUP_TOKENS = 10


def check_count(name: str, value) -> int:
    """``value`` as an int, where it is an integer (Python's or NumPy's; not a bool) >= 1.

    Raises:
        SpeculativeConfigError: naming ``name``, for anything else (a float, a string, None).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise SpeculativeConfigError(f"{name} must be an int >= 1, got {value!r}.")
    return int(value)


@dataclass(frozen=True)
class DraftSchedule:
    """The draft length per round, validated when made.

    Attributes:
        num_assistant_tokens: initial draft length k (>= 1) of a model drafter (prompt lookup alone: its length).
        schedule: ``"heuristic"`` (+2 after a round that took every draft, -1 otherwise, at least 1; transformers')
            or ``"constant"``.
        confidence_threshold: a model drafter stops a round when its top probability falls below this (0: off).
        cost_model: choose each round's length from measured verify costs and acceptance, and stop drafting with
            a model that cannot pay (:mod:`xpuspec.speculative.policy`); ``False`` drafts k every round.
        lookup_tokens: the longest draft of a round that costs no model step (``prompt_lookup_num_tokens``).

    Raises:
        SpeculativeConfigError: a count that is not an int >= 1, an unknown schedule, a threshold outside [0, 1),
            or a ``cost_model`` that is not a bool.
    """

    num_assistant_tokens: int = 4
    schedule: str = "heuristic"
    confidence_threshold: float = 0.0
    cost_model: bool = True
    lookup_tokens: int = DEFAULT_LOOKUP_TOKENS

    def __post_init__(self):
        object.__setattr__(self, "num_assistant_tokens", check_count("num_assistant_tokens", self.num_assistant_tokens))
        object.__setattr__(self, "lookup_tokens", check_count("prompt_lookup_num_tokens", self.lookup_tokens))
        if self.schedule not in ("heuristic", "constant"):
            raise SpeculativeConfigError(
                f"num_assistant_tokens_schedule must be 'heuristic' or 'constant', got {self.schedule!r}.")
        threshold = self.confidence_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0.0 <= threshold < 1.0:
            raise SpeculativeConfigError(
                f"assistant_confidence_threshold must be a number in [0, 1), got {threshold!r}.")
        object.__setattr__(self, "confidence_threshold", float(threshold))
        if not isinstance(self.cost_model, bool):
            raise SpeculativeConfigError(f"cost_model must be True or False, got {self.cost_model!r}.")

    def for_lookup(self) -> "DraftSchedule":
        """This schedule for prompt lookup alone: a constant ``lookup_tokens``."""
        return replace(self, num_assistant_tokens=self.lookup_tokens, schedule="constant")

    def next_k(self, k: int, drafted: int, accepted: int) -> int:
        """The model drafter's next k after a round that drafted ``drafted`` and accepted ``accepted``."""
        if self.schedule == "constant" or drafted == 0:
            return k
        return k + 2 if accepted == drafted else max(1, k - 1)
