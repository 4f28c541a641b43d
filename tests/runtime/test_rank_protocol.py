"""The batch headers rank 0 sends as int64 words come back as sent, a speculative step's kind and extra inputs
included; the payload's sizes follow them."""

from __future__ import annotations

from plugserve.core.forward_batch import ForwardMode
from plugserve.runtime.rank_protocol import Header, Step, decode_headers, encode_headers


def test_headers_round_trip_with_their_step_and_extra_inputs() -> None:
    headers = [Header(ForwardMode.DECODE, [5, 9], [1, 1], 3, 2),
               None,
               Header(ForwardMode.EXTEND, [7], [4], 2, 1, Step.SPEC_EXTEND, 5),
               Header(ForwardMode.TARGET_VERIFY, [12, 8], [4, 4], 4, 0, Step.SPEC_TREE, 2)]
    decoded = decode_headers(encode_headers(headers))
    assert decoded == headers
    assert [type(h.step) for h in decoded if h is not None] == [Step] * 3
    assert decoded[2] is not None and decoded[2].sizes == [4, 1, 2, 5]  # ids, sample rows, table, extra
    assert decoded[0] is not None and decoded[0].step is Step.FORWARD and decoded[0].sizes == [2, 2, 6, 0]
