"""The OpenAI-compatible server behind `qllama serve` (needs the `server` extra: Starlette, uvicorn).

- `schemas`: request bodies -> validated parameters; `ApiError` in OpenAI's error shape.
- `scheduler`: the continuous-batching loop (slots, waiting queue, one worker thread owns the model).
- `engine`: how a step reaches the model (one pass for all slots when the model can batch).
- `responses`: OpenAI response and stream-chunk objects.
- `app`: the Starlette routes, API key, body limit, SSE.

Only `app` imports Starlette, so the scheduler can be used (and tested) without it.
"""
