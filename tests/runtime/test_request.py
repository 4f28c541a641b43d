"""A request's generated tokens: PENDING ones (a batch in flight samples them) always last, counted, so that the
arrived ones are known without a scan of the output; the penalties' view of them copies nothing when none asks."""

from __future__ import annotations

from plugserve.runtime.request import PENDING, Request
from plugserve.runtime.sampling import SamplingParams


def _request(**params) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(**params), lambda output: None)


def test_pending_tokens_resolve_in_order_and_are_counted():
    request = _request()
    request.add_pending()
    request.add_pending()  # the next batch is planned before the one in flight arrives (overlap)
    assert request.output_ids == [PENDING, PENDING] and request.num_resolved == 0 and request.last_id == PENDING
    assert request.resolve(7) == 0 and request.output_ids == [7, PENDING] and request.num_resolved == 1
    assert request.resolve(8) == 1 and request.num_resolved == 2 and request.num_pending == 0
    assert request.resolve(9) == 2 and request.output_ids == [7, 8, 9]  # the rest of a verified run: appended
    request.add_pending()
    request.drop_pending()  # finished: the batch in flight's token is dropped
    assert request.output_ids == [7, 8, 9] and request.num_resolved == 3


def test_only_a_penalized_request_copies_its_tokens_for_the_sampler():
    plain, penalized = _request(), _request(frequency_penalty=0.5)
    for request in (plain, penalized):
        request.resolve(5)
        request.add_pending()
    assert plain.penalty_ids == [] and penalized.penalty_ids == [5]
