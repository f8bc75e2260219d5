"""The online server: an OpenAI-compatible HTTP front end (FastAPI + uvicorn, routes in `routes/`)
over the engine, which runs in a process of its own and streams each request's tokens back."""
