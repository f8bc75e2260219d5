"""The CPU tier's slot images: one slot of every buffer, packed per dtype; page-locked on a GPU,
where a load into a slot is asynchronous and lands exactly."""

from __future__ import annotations

import pytest
import torch

from compiled.lora.slot_image import SlotImage


def _buffers(device: str) -> list[torch.Tensor]:
    return [torch.zeros(3, 5, 7, dtype=torch.bfloat16, device=device),
            torch.zeros(3, 2, dtype=torch.float32, device=device),
            torch.zeros(3, 4, 1, 6, dtype=torch.bfloat16, device=device)]


def test_views_are_one_slot_of_each_buffer_in_disjoint_memory():
    buffers = _buffers("cpu")
    image = SlotImage(buffers, pin=False)
    assert [(v.shape, v.dtype) for v in image.views] == [(b.shape[1:], b.dtype) for b in buffers]
    assert all(not v.any() for v in image.views) and not image.pinned
    for i, v in enumerate(image.views):
        v.fill_(i + 1)
    assert [v.unique().tolist() for v in image.views] == [[1.0], [2.0], [3.0]]
    assert image.nbytes == 2 * (35 + 24) + 4 * 2


@pytest.mark.gpu
def test_page_locked_image_loads_into_a_slot_on_another_stream():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    buffers = _buffers("cuda")
    image = SlotImage(buffers, pin=True)
    assert image.pinned and all(v.is_pinned() for v in image.views)
    gen = torch.Generator().manual_seed(0)
    for v in image.views:
        v.copy_(torch.randn(v.shape, generator=gen))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for buf, v in zip(buffers, image.views):
            buf[1].copy_(v, non_blocking=True)
    stream.synchronize()
    for buf, v in zip(buffers, image.views):
        assert torch.equal(buf[1].cpu(), v) and not buf[0].any() and not buf[2].any()
    del image   # unregisters its blocks
