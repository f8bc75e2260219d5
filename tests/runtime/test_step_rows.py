"""Staging and reading back a step's rows: the rows it samples (consecutive ones come back as a view,
no gather, no index upload; any other set as a gather in the order asked) and its chunks' token fields."""

from __future__ import annotations

import torch

from compiled.runtime.model_runner import select_rows


def test_consecutive_rows_are_a_view_and_others_a_gather_in_order():
    x = torch.randn(9, 5)
    assert select_rows(x, []) is None
    for rows in ([0, 1, 2, 3, 4, 5, 6, 7, 8], [8], [3, 4, 5]):
        got = select_rows(x, rows)
        assert got.data_ptr() == x[rows[0]].data_ptr() and got.shape == (len(rows), 5)
        torch.testing.assert_close(got, x[rows])
    for rows in ([0, 2, 3], [5, 4], [1, 1], (7, 0, 8)):
        got = select_rows(x, rows)
        torch.testing.assert_close(got, x[list(rows)], rtol=0, atol=0)


def test_token_fields_of_short_and_long_chunks_land_in_step_order():
    """Decode-sized chunks gathered in lists and prompt-sized ones written by slices, interleaved:
    every field of every token where a plain concatenation puts it, the rest of the buffer untouched."""
    import numpy as np
    from types import SimpleNamespace
    from compiled.runtime.model_runner import SLICE_MIN_TOKENS, TokenFields

    def chunk(row, start, length, slot):
        ids = list(range(1000 * row, 1000 * row + start + length))
        request = SimpleNamespace(row=row, lora_slot=slot, token_ids=lambda a, b: ids[a:b])
        return SimpleNamespace(request=request, start=start, length=length)

    long = SLICE_MIN_TOKENS + 5
    chunks = [chunk(1, 7, 1, -1), chunk(2, 3, 2, 0), chunk(3, 0, long, 1), chunk(4, 9, 1, 2), chunk(5, 4, long, -1),
              chunk(6, 0, 3, 0)]
    h = {name: np.full(200, -7, dtype=np.int64) for name in ("input_ids", "positions", "token_rows", "lora_slots")}
    fields, t = TokenFields(h, lora=True), 0
    for c in chunks:
        fields.add(c, t)
        t += c.length
    fields.flush()
    want = {name: [] for name in h}
    for c in chunks:
        want["input_ids"] += c.request.token_ids(c.start, c.start + c.length)
        want["positions"] += range(c.start, c.start + c.length)
        want["token_rows"] += [c.request.row] * c.length
        want["lora_slots"] += [c.request.lora_slot] * c.length
    for name, values in want.items():
        assert h[name][:t].tolist() == values and (h[name][t:] == -7).all(), name
