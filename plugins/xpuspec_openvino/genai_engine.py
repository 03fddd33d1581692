"""Plain greedy decoding through ``openvino_genai.LLMPipeline``, on the same IR and device as the runner.

openvino_genai's C++ loop spends less time per token than xpuspec's Python loop around the same
compiled model (``benchmarks/results/HISTORY.md``, "Measurements that stood in docstrings"), so plain
greedy decoding runs there. Its SDPA backend runs the same stateful model as the runner (with the LM
head on the last position only), and its PA backend the same paged model, so the tokens are the ones
xpuspec's loop gives; speculative decoding, sampling, scores and logits stay in xpuspec's loop. The
pipeline is built on first use and holds its own copy of the compiled weights.
"""

from pathlib import Path
from typing import Callable, List, Sequence


def one_pass_scheduler():
    """openvino_genai's scheduler settings that compute a prompt as xpuspec's runner does: in one pass
    (no chunks of ``max_num_batched_tokens``) and afresh (no prefix cache: a cached prefix computes
    only the rest of the prompt, a different computation whose logits may differ at near-ties, and a
    benchmark that repeats a prompt would not time its prefill)."""
    import openvino_genai

    config = openvino_genai.SchedulerConfig()
    config.enable_prefix_caching = False
    config.max_num_batched_tokens = 2**31 - 1
    return config


class GenAIGreedy:
    """A lazily built ``openvino_genai.LLMPipeline`` for plain greedy decoding.

    Args:
        folder: the IR folder (with its OpenVINO tokenizer and detokenizer).
        device: OpenVINO device name (``"CPU"``, ``"GPU.1"``).
        config: the runner's compile properties.
        attention_backend: ``"SDPA"`` (the stateful model, as :class:`.runner.OpenVINORunner` runs it) or
            ``"PA"`` (paged attention, as :class:`.paged.PagedRunner` runs it): the runner's own numerics.
    """

    def __init__(self, folder: Path, device: str, config: dict, attention_backend: str = "SDPA"):
        self.folder, self.device, self.config = Path(folder), device, dict(config)
        self.attention_backend = attention_backend
        self._pipe = None

    def generate(self, prompt: List[int], max_new_tokens: int, min_new_tokens: int, eos: Sequence[int],
                 on_token: Callable[[int], None]) -> List[int]:
        """Greedy continuation of ``prompt``; see :meth:`xpuspec.runner.Runner.native_greedy`."""
        import numpy as np
        import openvino as ov
        import openvino_genai

        if self._pipe is None:
            extra = {}
            if self.attention_backend == "PA":
                extra["scheduler_config"] = one_pass_scheduler()
            self._pipe = openvino_genai.LLMPipeline(str(self.folder), self.device, ATTENTION_BACKEND=self.attention_backend,
                                                    **extra, **self.config)
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens, config.min_new_tokens = max_new_tokens, min_new_tokens
        config.do_sample, config.apply_chat_template = False, False
        config.stop_token_ids = set(eos)
        if eos:
            config.eos_token_id = eos[0]
        else:
            config.ignore_eos = True

        raised: List[BaseException] = []

        class Streamer(openvino_genai.StreamerBase):
            """Hands each token to ``on_token``. An exception there (a user's streamer failing, Ctrl-C, whose
            KeyboardInterrupt Python raises in this callback) must not cross into C++, where it would abort
            the process: it cancels the generation and is raised again once the engine returns."""

            def write(self, token):
                try:
                    for t in token if isinstance(token, list) else [token]:
                        on_token(int(t))
                except BaseException as exc:  # noqa: B036 - re-raised below, after the C++ loop has stopped
                    raised.append(exc)
                    return openvino_genai.StreamingStatus.CANCEL
                return openvino_genai.StreamingStatus.RUNNING

            def end(self):
                pass

        result = self._pipe.generate(ov.Tensor(np.asarray([prompt], dtype=np.int64)), config, Streamer())
        if raised:
            raise raised[0]
        return [int(t) for t in result.tokens[0]]
