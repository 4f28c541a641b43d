"""The serving log: one line per finished request (--log-requests) and SGLang's decode batch line every
--decode-log-interval decode steps, so that `grep "Decode batch"` works on plugserve's logs as on SGLang's."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugserve.runtime.metrics import SchedulerGauges
    from plugserve.runtime.request import Request
    from plugserve.runtime.server_args import ServerArgs

logger = logging.getLogger("plugserve.stats")


class StatsLog:
    def __init__(self, args: ServerArgs, max_total_tokens: int, decode: Callable[[Sequence[int]], str]) -> None:
        """`decode`: token ids to text (the prompt of a --log-requests-level 2 line)."""
        self.log_requests, self.level = args.log_requests, args.log_requests_level
        self.interval, self.capacity, self.decode = args.decode_log_interval, max_total_tokens, decode
        self._decode_steps = 0

    def request_finished(self, request: Request) -> None:
        """With --log-requests: the request's id, finish, tokens and latency (and more at higher levels)."""
        if not self.log_requests:
            return
        line = (f"Finished request {request.rid}: finish_reason={request.finish_reason}, "
                f"prompt_tokens={len(request.prompt_ids)}, cached_tokens={request.cached_tokens}, "
                f"completion_tokens={request.num_resolved}, "
                f"e2e_latency={time.perf_counter() - request.arrival_time:.3f}s")
        if request.first_token_time is not None:
            line += f", ttft={request.first_token_time - request.arrival_time:.3f}s"
        if self.level >= 1:
            line += f", sampling_params={request.params}"
        if self.level >= 2:
            line += f", prompt={self.decode(request.prompt_ids)!r}, output={request.text!r}"
        logger.info(line)

    def decode_step(self, gauges: SchedulerGauges, throughput: float) -> None:
        """Every --decode-log-interval decode steps: SGLang's batch statistics line."""
        self._decode_steps += 1
        if self._decode_steps % self.interval:
            return
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                    "#queue-req: %d", gauges.num_running, round(gauges.kv_usage * self.capacity), gauges.kv_usage,
                    throughput, gauges.num_waiting)
