"""`ForwardBatch.build`'s Triton kernel (`triton_forward_batch.token_layout`) against the torch ops it replaces, for
decode, chains of one length, ragged prefills (a request with no new token among them, one longer than a block)
and page sizes 1, 16 and 64. Without a GPU it runs in Triton's interpreter (tests/interpreter.py)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.kv_cache import MLAKVPool, pages_needed
from tests.interpreter import interpreter_child, kernels_fixture

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

kernels = kernels_fixture("plugserve.core.triton_forward_batch")
test_kernels_in_the_interpreter = interpreter_child(__file__)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize(("seq_lens", "extend_lens"), [
    ([5, 1, 300, 17], [1, 1, 1, 1]),  # decode
    ([9, 40, 4], [4, 4, 4]),  # chains: a speculative round's verify
    ([30, 7, 1500, 12], [30, 0, 1300, 5]),  # ragged prefill over cached prefixes; 1300 tokens: two blocks
], ids=["decode", "chains", "ragged"])
def test_matches_the_torch_ops(kernels: ModuleType, page_size: int, seq_lens: list[int], extend_lens: list[int]
                               ) -> None:
    pool = MLAKVPool(1, 4 * pages_needed(max(seq_lens), page_size) + 1, page_size, 16, 8, torch.float32, DEVICE)
    width = pages_needed(max(seq_lens), page_size)
    pages = torch.randperm(pool.num_pages - 1)[: len(seq_lens) * width].view(len(seq_lens), width)
    table = pages.to(torch.int32).to(DEVICE)
    batch = ForwardBatch.build(ForwardMode.EXTEND, seq_lens, extend_lens, table, pool)
    positions, slots = kernels.token_layout(batch.seq_lens, batch.extend_lens, batch.cu_extend_lens, table, page_size,
                                            sum(extend_lens), max(extend_lens))
    expected = torch.cat([torch.arange(s - e, s) for s, e in zip(seq_lens, extend_lens, strict=True)])
    assert torch.equal(positions.cpu(), expected)
    rows = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(extend_lens))
    assert torch.equal(slots.cpu(), pages[rows, expected // page_size].long() * page_size + expected % page_size)
    assert torch.equal(batch.positions.cpu(), expected) and torch.equal(batch.out_cache_loc.cpu(), slots.cpu())


def test_no_requests_or_no_new_tokens(kernels: ModuleType) -> None:
    table = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([3, 3], dtype=torch.int32, device=DEVICE)
    zeros = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    positions, slots = kernels.token_layout(lens, zeros, torch.zeros(3, dtype=torch.int32, device=DEVICE), table, 16,
                                            0, 0)
    assert positions.numel() == 0 and slots.numel() == 0
