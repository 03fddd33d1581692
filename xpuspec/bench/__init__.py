"""``xpuspec bench``: xpuspec against transformers, optimum-intel and openvino_genai on the same weights,
prompts and machine. Modules: :mod:`.systems` (the competitors and how a call is timed), :mod:`.worker`
(one process per system), :mod:`.prompts`, :mod:`.roofline`, :mod:`.report`, :mod:`.harness` (the run
and the CLI options)."""
