import pytest
import torch

from plugserve.core.dispatch import choose_attn_forward_method, prepare_attention
from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode
from plugserve.core.kv_cache import MLAKVPool

MHA, CHUNKED, MLA = AttnForwardMethod.MHA, AttnForwardMethod.MHA_CHUNKED_KV, AttnForwardMethod.MLA


@pytest.mark.parametrize(
    ("mode", "prefix", "new", "supports_mla", "expected"),
    [
        (ForwardMode.EXTEND, [0, 0], [100, 5], True, MHA),
        (ForwardMode.EXTEND, [100, 0], [5, 5], True, MLA),
        (ForwardMode.EXTEND, [100, 0], [5, 5], False, MHA),  # MHA-only prefill backend, fits one chunk
        (ForwardMode.EXTEND, [6000, 2192], [10, 10], True, MHA),  # sum 8192 >= threshold, fits 16384
        (ForwardMode.EXTEND, [16000, 2000], [10, 10], True, CHUNKED),
        (ForwardMode.EXTEND, [30000], [1], False, CHUNKED),
        (ForwardMode.DECODE, [0, 50000], [1, 1], True, MLA),
        (ForwardMode.TARGET_VERIFY, [10], [4], True, MLA),
        (ForwardMode.DRAFT_EXTEND, [10], [2], False, MLA),
    ],
)
def test_dispatch_rule(mode, prefix, new, supports_mla, expected):
    seq = [p + n for p, n in zip(prefix, new, strict=True)]
    method, reason = choose_attn_forward_method(mode, prefix, seq, prefill_supports_mla=supports_mla)
    assert method is expected and reason


@pytest.mark.parametrize(("prefix", "new"), [([0, 0], [100, 5]), ([100, 0], [5, 5]), ([16000, 2000], [10, 10])])
def test_deterministic_inference_runs_every_prefill_as_absorbed_mla(prefix, new):
    """One path whether or not a prefix is cached, and however long: a token's arithmetic never changes with it."""
    seq = [p + n for p, n in zip(prefix, new, strict=True)]
    method, reason = choose_attn_forward_method(ForwardMode.EXTEND, prefix, seq, deterministic=True)
    assert method is MLA and "deterministic" in reason
    with pytest.raises(ValueError, match="absorbed MLA"):
        choose_attn_forward_method(ForwardMode.EXTEND, prefix, seq, prefill_supports_mla=False, deterministic=True)


def test_threshold_is_configurable():
    method, reason = choose_attn_forward_method(ForwardMode.EXTEND, [100], [110], chunked_prefix_cache_threshold=64)
    assert method is MHA and "--chunked-prefix-cache-threshold 64" in reason


def test_prefix_chunks_cover_every_prefix_token_once_within_capacity():
    page_size, prefix, new = 4, [37, 0, 10], [3, 2, 1]
    pool = MLAKVPool(1, 32, page_size, 8, 4, torch.float32, "cpu")
    block_table = torch.randperm(32)[:30].view(3, 10).to(torch.int32)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [p + n for p, n in zip(prefix, new, strict=True)], new,
                               block_table, pool)
    prepare_attention(batch, chunked_prefix_cache_threshold=1, prefix_chunk_capacity=8)
    assert batch.attn_method is CHUNKED
    assert all(sum(c.lens_cpu) <= 8 for c in batch.prefix_chunks)
    for request, length in enumerate(prefix):
        positions = [s + i for c in batch.prefix_chunks
                     for s, n in [(c.starts_cpu[request], c.lens_cpu[request])] for i in range(n)]
        assert positions == list(range(length))
    expected_slots = [int(block_table[r, p // page_size]) * page_size + p % page_size
                      for c in batch.prefix_chunks for r in range(3)
                      for p in range(c.starts_cpu[r], c.starts_cpu[r] + c.lens_cpu[r])]
    assert torch.cat([c.slots for c in batch.prefix_chunks]).tolist() == expected_slots
    assert [c.cu_lens.tolist()[-1] for c in batch.prefix_chunks] == [sum(c.lens_cpu) for c in batch.prefix_chunks]
