"""Serving the app on uvicorn, draining on SIGTERM / Ctrl-C."""

from __future__ import annotations

import contextlib
import signal

import uvicorn
from fastapi import FastAPI


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that once SIGTERM / Ctrl-C has drained the in-flight requests it
    returns (exit status 0) instead of raising the signal again."""

    @contextlib.contextmanager
    def capture_signals(self):
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def listen(app: FastAPI, host: str, port: int) -> None:
    """Serve until SIGTERM / Ctrl-C, then finish the requests in flight and return."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=600)
    DrainingServer(config).run()
