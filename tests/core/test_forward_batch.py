import pytest
import torch

from plugserve.core.forward_batch import ForwardBatch, ForwardMode, Phase
from plugserve.core.kv_cache import MLAKVPool


def _pool(page_size: int = 4) -> MLAKVPool:
    return MLAKVPool(num_layers=2, num_pages=8, page_size=page_size, kv_lora_rank=6, qk_rope_head_dim=2,
                     dtype=torch.float32, device="cpu")


def test_build_derives_positions_and_slots_from_the_block_table():
    block_table = torch.tensor([[5, 2, 0], [7, 0, 0]], dtype=torch.int32)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [6, 3], [3, 2], block_table, _pool())
    assert batch.positions.tolist() == [3, 4, 5, 1, 2]
    # request 0: positions 3 -> page 5 offset 3; 4, 5 -> page 2 offsets 0, 1. Request 1: page 7.
    assert batch.out_cache_loc.tolist() == [23, 8, 9, 29, 30]
    assert batch.prefix_lens_cpu == [3, 1] and batch.num_tokens == 5 and batch.batch_size == 2
    assert batch.cu_extend_lens.tolist() == [0, 3, 5]


@pytest.mark.parametrize(
    ("mode", "seq", "new", "message"),
    [
        (ForwardMode.DECODE, [4], [2], "exactly one new token"),
        (ForwardMode.EXTEND, [2], [3], "extend length"),
        (ForwardMode.EXTEND, [2, 2], [1], "same requests"),
    ],
)
def test_build_rejects_inconsistent_lengths(mode, seq, new, message):
    with pytest.raises(ValueError, match=message):
        ForwardBatch.build(mode, seq, new, torch.zeros(len(seq), 2, dtype=torch.int32), _pool())


def test_modes_map_to_the_phase_whose_backend_runs_them():
    assert ForwardMode.EXTEND.phase is Phase.PREFILL
    assert {m.phase for m in ForwardMode if m is not ForwardMode.EXTEND} == {Phase.DECODE}


def test_pool_write_gather_and_views():
    pool = _pool(page_size=2)
    slots = torch.tensor([3, 10])
    latent, rope = torch.randn(2, 6), torch.randn(2, 2)
    pool.write(1, slots, latent, rope)
    assert torch.equal(pool.gather(1, slots), torch.cat([latent, rope], dim=1))
    assert torch.equal(pool.latent(1)[slots], latent) and torch.equal(pool.rope(1)[slots], rope)
    assert torch.equal(pool.paged(1)[5, 0], pool.buffer(1)[10])
    assert pool.buffer(0).abs().sum() == 0  # other layer untouched
