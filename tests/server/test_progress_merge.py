"""A handler takes every report already queued for its HTTP request with the one it waited for,
merged per engine request: tokens and logprobs in order, the last report's finish. Reports of a
request it has finished (past a stop string it found) are dropped; an engine error or the
client's leaving ends the wait."""

from __future__ import annotations

import asyncio

import pytest

from compiled.server.choices import next_reports
from compiled.server.messages import Progress
from compiled.server.protocol import APIError


def _reports(*items, done=()):
    async def run():
        q: asyncio.Queue = asyncio.Queue()
        for item in items:
            q.put_nowait(item)
        return await next_reports(q, set(done)), q.qsize()
    return asyncio.run(run())


def test_queued_reports_merge_per_request_in_order():
    (got, left) = _reports((1, Progress([7], [{7: -2.0}], False)), (0, Progress([3], [{3: -1.0}], False)),
                           (1, Progress([8], [{8: -0.5}], False)), (1, Progress([9], [{9: -0.1}], True, "length")))
    assert left == 0 and [i for i, _ in got] == [1, 0]
    merged = got[0][1]
    assert merged.token_ids == [7, 8, 9] and merged.logprobs == [{7: -2.0}, {8: -0.5}, {9: -0.1}]
    assert merged.finished and merged.finish_reason == "length"
    assert got[1][1].token_ids == [3] and not got[1][1].finished


def test_reports_of_finished_requests_are_dropped():
    got, _ = _reports((0, Progress([4], None, False)), (1, Progress([5], None, False)), done={0})
    assert [(i, p.token_ids) for i, p in got] == [(1, [5])]


def test_an_engine_error_is_a_500_naming_it():
    with pytest.raises(APIError, match="step failed"):
        _reports((0, Progress([4], None, False)), (0, RuntimeError("step failed")))


def test_the_client_leaving_cancels():
    with pytest.raises(asyncio.CancelledError):
        _reports((0, Progress([4], None, False)), (None, None))
