"""`quill serve`: an OpenAI-compatible HTTP server with continuous batching and a web page.

Needs the optional "serve" extra (`pip install -e ".[serve]"`: fastapi, uvicorn).
Modules: `server` (the HTTP server: start-up, listen, drain), `routes` (the app: routes, SSE,
auth, limits), `connections` (per-connection deadlines and the lingering close), `schemas`
(strict request bodies), `responses` (OpenAI's objects), `batcher` (the one engine task),
`errors` (OpenAI-shaped errors), `access_log` (a line per request), `static/` (the page).
"""
