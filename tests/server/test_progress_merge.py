"""A handler behind the engine takes every report already queued for its request as one: tokens
and logprobs in order, the last report's finish; an engine error queued behind wins."""

from __future__ import annotations

import asyncio

from compiled.server.app import _with_queued
from compiled.server.engine_thread import Progress


def _queue(*items) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    for item in items:
        q.put_nowait(item)
    return q


def test_queued_reports_merge_up_to_the_finish():
    q = _queue(Progress([8], [{8: -0.5}], False), Progress([9], [{9: -0.1}], True, "length"),
               Progress([10], [{10: -1.0}], False))
    merged = _with_queued(Progress([7], [{7: -2.0}], False), q)
    assert merged.token_ids == [7, 8, 9] and merged.logprobs == [{7: -2.0}, {8: -0.5}, {9: -0.1}]
    assert merged.finished and merged.finish_reason == "length"
    assert q.qsize() == 1   # nothing after the finish is taken


def test_an_error_behind_the_report_is_returned():
    error = RuntimeError("step failed")
    assert _with_queued(Progress([7], None, False), _queue(Progress([8], None, False), error)) is error


def test_nothing_queued_leaves_the_report_as_it_is():
    p = Progress([7], None, False)
    assert _with_queued(p, _queue()) is p
