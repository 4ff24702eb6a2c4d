"""The engine behind an OpenAI-compatible HTTP endpoint (FastAPI + uvicorn, server-sent events, /metrics),
and the load test that measures any such endpoint from the client side (the `openai` package)."""
from .app import build_app, running, serve
from .async_engine import AsyncEngine
from .protocol import ApiError, Request, parse
