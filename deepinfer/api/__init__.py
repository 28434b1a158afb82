"""The HTTP API over the engine: `app.create_app(engine)` builds it, `server.serve(config)` runs it
with uvicorn in the engine's loop.

Here: the engine seam (`protocol.py`), the context every route shares (`context.py`), the request
limits (`limits.py`) and engine output streams (`streams.py`). Below: `http/` (plumbing shared by
every route), `tools/` (tools and structured output, shared by the three protocols), `openai/`,
`anthropic/` and `responses/` (one folder per wire protocol), `ops/` (metrics, stats and the web
pages).
"""
