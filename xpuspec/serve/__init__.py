"""``xpuspec serve``: an OpenAI-compatible HTTP server (completions, chat completions, models, health, metrics).

Needs the ``[serve]`` extra (FastAPI, uvicorn, prometheus-client), imported only inside this package.

- :mod:`.command`: the command's arguments and start-up (light to import);
- :mod:`.app`: routes, streaming, auth and errors; :mod:`.protocol`: the OpenAI request and response shapes;
- :mod:`.admission`: the bounded queue (429); :mod:`.session`: one request between the event loop and its worker
  thread; :mod:`.drain`: SIGTERM's drain and its deadline; :mod:`.metrics`: Prometheus;
- :mod:`.backend`: everything asked of the model, behind :class:`.backend.SerialBackend`.
"""
