"""The OpenAI-compatible HTTP server (`outrider serve`): FastAPI routes in front of one engine,
stepped in a process of its own (or a thread). Importing this package is cheap; FastAPI,
uvicorn and the engine load on use."""
