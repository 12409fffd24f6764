"""The OpenAI-compatible HTTP server (`outrider serve`): FastAPI routes in front of one engine
thread. Importing this package is cheap; FastAPI, uvicorn and the engine load on use."""
