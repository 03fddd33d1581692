"""The engine's sizes, in a module without imports so that the CLI's parser reads them without loading torch."""

#: The most rows one engine step verifies; more jobs wait. The one definition: the engine's default and the
#: server's ``--max-batch`` default.
DEFAULT_MAX_BATCH = 16

#: Seconds of prompt prefill an engine step may spend while other rows decode (a prompt alone prefills in one pass):
#: a chunk takes the tokens this buys at the prefill rate the engine measured on its earlier prefill passes, so a
#: long prompt delays the running rows by about this much per step whatever the machine, the model and the load.
PREFILL_BUDGET_S = 0.15

#: Prompt tokens of a chunk before any prefill pass was timed: few, so that the first chunk too stays near the budget
#: on a slow machine (256 tokens took 0.7 s on a 2-core AVX2 EPYC with SmolLM2; benchmarks/results/engine.md).
PREFILL_CHUNK = 64

#: The fewest prompt tokens a chunk takes (a pass has a fixed cost, which smaller chunks would mostly pay).
MIN_PREFILL_CHUNK = 16
