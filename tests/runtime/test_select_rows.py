"""The rows a step samples: consecutive rows come back as a view (no gather, no index upload),
any other set as a gather in the order asked."""

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
