"""The batch headers rank 0 sends as int64 words come back as sent, a speculative step's kind and extra inputs
included; the payload's sizes follow them. `GroupRows` finds a DP group's rows among every group's."""

from __future__ import annotations

import torch

from plugserve.core.distributed import SINGLE
from plugserve.core.forward_batch import ForwardMode
from plugserve.runtime.rank_protocol import GroupRows, Header, Step, decode_headers, encode_headers


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


def test_group_rows_name_every_groups_rows_and_find_one_groups() -> None:
    rows = GroupRows([2, 0, 3], 2, True)  # group 1 idle; this rank runs group 2
    every = torch.arange(10).view(5, 2)  # two rows per counted one: group 0's 4, then group 2's 6
    assert rows.times(2) == [4, 0, 6]
    assert rows.own(every.view(-1, 1), per=2).view(-1).tolist() == [4, 5, 6, 7, 8, 9]
    assert GroupRows([2, 0, 3], 1, True).own(every).numel() == 0
    one = GroupRows([4], 0, False)  # without DP attention: no gathers, every row this rank's
    assert one.times(3) is None and one.gather(SINGLE, every).equal(every) and one.own(every[:4]).equal(every[:4])
