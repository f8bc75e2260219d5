"""The bitmask op against its torch reference, on random masks and logits of vocabulary sizes that
are and are not multiples of 32, for every row or a few: on the CPU xgrammar's kernel, and the
Triton kernel the GPU runs under `TRITON_INTERPRET=1` (in a subprocess); on the GPU at the 30B's
vocabulary."""

from __future__ import annotations

import pytest
import torch

from compiled.structured.bitmask import GrammarMask, allowed_ref, apply_bitmask_, apply_bitmask_ref, bitmask_width


def _random_bitmask(rows: int, vocab: int, generator: torch.Generator, density: float = 0.3) -> torch.Tensor:
    bits = torch.rand(rows, bitmask_width(vocab) * 32, generator=generator) < density
    words = (bits.view(rows, -1, 32).long() << torch.arange(32)).sum(-1)
    return words.to(torch.int64).where(words < 2**31, words - 2**32).to(torch.int32)


@pytest.mark.parametrize("vocab", [33, 269, 288, 1000, 4099])
@pytest.mark.parametrize("rows", [None, [0], [1, 3]])
def test_kernel_equals_reference(vocab, rows):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    bitmask = _random_bitmask(5, vocab, g)
    rows = list(range(5)) if rows is None else rows
    expected, got = logits.clone(), logits.clone()
    apply_bitmask_ref(expected, bitmask, rows)
    apply_bitmask_(got, bitmask, rows)
    assert torch.equal(got, expected)
    untouched = [r for r in range(5) if r not in rows]
    assert torch.equal(got[untouched], logits[untouched])
    assert torch.isinf(got[rows]).any() and torch.isfinite(got[rows]).any()


def test_reference_reads_bit_j_of_word_w_as_token_32w_plus_j():
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5
    bitmask[0, 1] = -2**31    # bit 31 of word 1: token 63
    allowed = allowed_ref(bitmask, 64)[0]
    assert allowed.nonzero().flatten().tolist() == [5, 63]


def test_logits_wider_than_the_mask_are_masked_past_it():
    # A model vocabulary (padded) beyond the one the mask covers: those ids are never allowed.
    logits = torch.zeros(2, 70)
    bitmask = torch.full((2, 1), -1, dtype=torch.int32)   # allows ids 0..31 only
    expected = logits.clone()
    apply_bitmask_ref(expected, bitmask, [1])
    apply_bitmask_(logits, bitmask, [1])
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[1, 32:]).all() and torch.isfinite(logits[1, :32]).all()
    assert torch.isfinite(logits[0]).all()


def test_patch_argmax_retakes_only_masked_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 9.0, 2.0]])
    argmax = logits.argmax(-1)
    bitmask = torch.tensor([[0b111], [0b101]], dtype=torch.int32)
    mask = GrammarMask(bitmask, [1])
    mask.apply(logits)
    assert mask.patch_argmax(logits, argmax).tolist() == [1, 0]


@pytest.mark.gpu
def test_kernel_equals_reference_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(0)
    for vocab in (151_936, 269):
        logits = torch.randn(64, vocab, generator=g).cuda()
        bitmask = _random_bitmask(64, vocab, g).cuda()
        rows = list(range(0, 64, 3))
        expected, got = logits.clone(), logits.clone()
        apply_bitmask_ref(expected, bitmask, rows)
        apply_bitmask_(got, bitmask, rows)
        assert torch.equal(got, expected)


def interpreted() -> dict:
    """The Triton kernel on random masks (run under TRITON_INTERPRET=1 by the fixture below)."""
    from compiled.structured.bitmask import apply_bitmask_triton
    results = {}
    g = torch.Generator().manual_seed(1)
    for vocab, width, rows in ((33, 2, [0, 2]), (269, 9, [1]), (4099, 129, [0, 1, 2]), (300, 5, [2, 0])):
        logits = torch.randn(3, vocab, generator=g)
        bitmask = _random_bitmask(3, width * 32, g, density=0.5)   # width * 32 < vocab: the rest is masked
        expected, got = logits.clone(), logits.clone()
        apply_bitmask_ref(expected, bitmask, rows)
        apply_bitmask_triton(got, bitmask, torch.tensor(rows))
        results[f"{vocab}/{width}/{rows}"] = torch.equal(got, expected)
    return results


@pytest.fixture(scope="module")
def interpreted_results() -> dict:
    from tests.linear.test_linear_kernel import run_interpreted
    return run_interpreted(__file__)


def test_interpreted_triton_kernel_equals_reference(interpreted_results):
    assert len(interpreted_results) == 4 and all(interpreted_results.values()), interpreted_results


if __name__ == "__main__":   # run by the fixture above under TRITON_INTERPRET=1
    import json
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    print(json.dumps(interpreted()))
