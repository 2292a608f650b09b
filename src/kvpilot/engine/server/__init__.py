"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) around the engine."""
