"""The engine's sizes, in a module without imports so that the CLI's parser reads them without loading torch."""

#: The most rows one engine step verifies; more jobs wait. The one definition: the engine's default and the
#: server's ``--max-batch`` default.
DEFAULT_MAX_BATCH = 16

#: Prompt tokens a row prefills per engine step while other rows decode (a prompt alone prefills in one pass).
PREFILL_CHUNK = 256
