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


@pytest.mark.parametrize("batch_size", [1, 2, 3, 5])
def test_build_starts_every_length_tensor_16_byte_aligned(batch_size: int):
    """Triton compiles once per pointer alignment: an odd batch must not hand kernels misaligned lengths."""
    seq, new = [4 + i for i in range(batch_size)], [1 + i % 3 for i in range(batch_size)]
    batch = ForwardBatch.build(ForwardMode.EXTEND, seq, new, torch.zeros(batch_size, 3, dtype=torch.int32), _pool())
    for lengths in (batch.seq_lens, batch.extend_lens, batch.cu_extend_lens):
        assert lengths.data_ptr() % 16 == 0
    assert batch.seq_lens.tolist() == seq and batch.extend_lens.tolist() == new
    assert batch.cu_extend_lens.tolist() == [0, *torch.tensor(new).cumsum(0).tolist()]


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


def test_build_of_equal_chains_lays_out_every_requests_tokens():
    block_table = torch.tensor([[5, 2, 0], [7, 1, 0], [3, 4, 6]], dtype=torch.int32)
    verify = ForwardBatch.build(ForwardMode.TARGET_VERIFY, [6, 4, 12], [4, 4, 4], block_table, _pool())
    assert verify.positions.tolist() == [2, 3, 4, 5, 0, 1, 2, 3, 8, 9, 10, 11]
    assert verify.out_cache_loc.tolist() == [22, 23, 8, 9, 28, 29, 30, 31, 24, 25, 26, 27]
    assert verify.positions.dtype == verify.out_cache_loc.dtype == torch.int64


@pytest.mark.parametrize("j", [0, 1, 3])
def test_a_chains_token_as_decode_is_what_build_gives(j: int):
    block_table = torch.tensor([[5, 2, 0], [7, 1, 0], [3, 4, 6]], dtype=torch.int32)
    verify = ForwardBatch.build(ForwardMode.TARGET_VERIFY, [6, 4, 12], [4, 4, 4], block_table, _pool())
    decode = verify.token_as_decode(j)
    expected = ForwardBatch.build(ForwardMode.DECODE, [2 + j + 1, 0 + j + 1, 8 + j + 1], [1, 1, 1], block_table,
                                  _pool())
    assert decode.mode is ForwardMode.DECODE and decode.block_table is block_table
    assert decode.seq_lens_cpu == expected.seq_lens_cpu and decode.extend_lens_cpu == [1, 1, 1]
    for name in ("seq_lens", "extend_lens", "cu_extend_lens", "positions", "out_cache_loc"):
        got, want = getattr(decode, name), getattr(expected, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name


@pytest.mark.parametrize("j", [-1, 4])
def test_token_as_decode_refuses_tokens_the_chains_lack(j: int):
    verify = ForwardBatch.build(ForwardMode.TARGET_VERIFY, [6], [4], torch.tensor([[5, 2]], dtype=torch.int32),
                                _pool())
    with pytest.raises(ValueError, match="batch of chains"):
        verify.token_as_decode(j)


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
