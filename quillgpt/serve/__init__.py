"""`quill serve`: an OpenAI-compatible HTTP server with continuous batching and a web page.

Needs the optional "serve" extra (`pip install -e ".[serve]"`: fastapi, uvicorn).
Modules: `server` (start-up, listen, drain), `app` (routes, SSE, auth, limits), `schemas`
(strict request bodies), `responses` (OpenAI's objects),
`batcher` (the one engine task), `errors` (OpenAI-shaped errors), `static/` (the page).
"""
