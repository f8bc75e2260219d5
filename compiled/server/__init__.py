"""The online server: an OpenAI-compatible HTTP front end (FastAPI + uvicorn) over the engine,
which runs in a process of its own and streams each request's tokens back as they resolve."""
