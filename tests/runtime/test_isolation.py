"""A failed forward fails only the requests whose own forward raises (the engine's fault hook makes one request's
forward raise, in its prefill or mid-decode): its prefill batch-mates, the requests decoding beside it and those
of the batch planned meanwhile (overlap) finish with the tokens they get alone; the engine serves on afterwards
with every KV page back. The tiny preset's random unquantized weights give batch-invariant greedy tokens, so
"alone" is exact."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence

import pytest
import torch

from plugserve.core.forward_batch import ForwardMode
from plugserve.runtime.engine import Engine
from plugserve.runtime.isolation import merge
from plugserve.runtime.request import FinishReason, Request
from plugserve.runtime.sampling import SampleOutput, SamplingParams
from plugserve.runtime.server_args import ServerArgs
from tests.engine_checks import assert_every_page_is_back

GREEDY = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
RUNNING = ["Hello, my name is", "The capital of France is"]
BATCH = ["def fibonacci(n):", "A prompt whose forward raises", "import numpy as np\n" * 5]
BAD = 1  # BATCH[BAD] fails


class Faults:
    """The fault hook: raises for every forward holding the bad request (by prompt) in `stage`; records each
    EXTEND batch's prompts."""

    def __init__(self, stage: ForwardMode) -> None:
        self.stage, self.bad_ids = stage, None
        self.extends: list[list[list[int]]] = []

    def __call__(self, mode: ForwardMode, requests: Sequence[Request]) -> None:
        if mode is ForwardMode.EXTEND:
            self.extends.append([r.prompt_ids for r in requests])
        # Mid-decode: once the bad request holds a few tokens (PENDING ones count, as in the batch in flight).
        if mode is self.stage and any(r.prompt_ids == self.bad_ids and (mode is ForwardMode.EXTEND
                                                                        or len(r.output_ids) > 3) for r in requests):
            raise RuntimeError("injected fault")


@pytest.mark.parametrize("stage", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["prefill", "decode"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_failing_forward_fails_only_its_own_request(overlap: bool, stage: ForwardMode) -> None:
    faults = Faults(stage)
    engine = Engine(ServerArgs(model_preset="tiny", disable_overlap_schedule=not overlap), fault_hook=faults)
    try:
        assert engine.ready.wait(60)
        alone = {p: engine.generate(p, LONG if p in RUNNING else GREEDY)[0].token_ids for p in RUNNING + BATCH}
        faults.bad_ids = engine.tokenize(BATCH[BAD])
        running: dict[str, list] = {p: [] for p in RUNNING}
        done = threading.Semaphore(0)
        for prompt in RUNNING:
            def on_output(output, outputs=running[prompt]):
                outputs.append(output)
                if output.finished:
                    done.release()
            engine.submit(prompt, LONG, on_output)
        deadline = time.monotonic() + 30
        while min(sum(len(o.token_ids) for o in outs) for outs in running.values()) < 2:
            assert time.monotonic() < deadline, "the running requests did not start"
            time.sleep(0.005)
        results = engine.generate(BATCH, GREEDY)  # queued at once: one prefill batch, beside the decoding ones
        for _ in RUNNING:
            assert done.acquire(timeout=60), "a running request hung"

        batch_ids = [engine.tokenize(p) for p in BATCH]
        assert batch_ids in faults.extends, "the three prompts were not prefilled in one batch"
        assert results[BAD].finish_reason is FinishReason.ERROR
        assert results[BAD].error == "RuntimeError: injected fault"
        for i, prompt in enumerate(BATCH):
            if i != BAD:
                assert results[i].finish_reason is FinishReason.LENGTH, results[i].error
                assert results[i].token_ids == alone[prompt]
        for prompt, outputs in running.items():
            assert outputs[-1].finish_reason is FinishReason.LENGTH, outputs[-1].error
            assert [t for o in outputs for t in o.token_ids] == alone[prompt]
        if stage is ForwardMode.DECODE:
            assert len(results[BAD].token_ids) >= 2  # it failed mid-decode, after tokens it did get
        # The engine serves on, the failed request's KV reused by nobody.
        assert [r.token_ids for r in engine.generate(BATCH[:1] + RUNNING, GREEDY)] == [
            alone[BATCH[0]], *(alone[p][: GREEDY.max_new_tokens] for p in RUNNING)]
        engine.check_pool_accounting()
        assert_every_page_is_back(engine)
    finally:
        engine.shutdown()


def test_a_batch_whose_every_request_fails_fails_each_with_the_error() -> None:
    def fail_all(mode: ForwardMode, requests: Sequence[Request]) -> None:
        if mode is ForwardMode.EXTEND:
            raise RuntimeError("every forward fails")

    engine = Engine(ServerArgs(model_preset="tiny"), fault_hook=fail_all)
    try:
        results = engine.generate(BATCH, GREEDY)
        assert all(r.finish_reason is FinishReason.ERROR and r.error == "RuntimeError: every forward fails"
                   for r in results)
        assert_every_page_is_back(engine)
    finally:
        engine.shutdown()


def test_merge_puts_each_parts_rows_in_place_and_pads_narrower_top_logprobs() -> None:
    wide = SampleOutput(torch.tensor([7, 8]), torch.tensor([-0.5, -1.0]), torch.tensor([[7, 1], [8, 2]]),
                        torch.tensor([[-0.5, -2.0], [-1.0, -3.0]]))
    narrow = SampleOutput(torch.tensor([9]), None, None, None)
    merged = merge([([0, 3], wide), ([2], narrow)], 4)
    assert merged.token_ids.tolist() == [7, 0, 9, 8]
    assert merged.logprobs.tolist() == [-0.5, 0.0, 0.0, -1.0]
    assert merged.top_logprob_ids.tolist() == [[7, 1], [0, 0], [0, 0], [8, 2]]
    assert merged.accept_lens is None


def test_a_constrained_batch_mate_of_a_failing_request_keeps_its_grammar() -> None:
    """The re-run part samples under its requests' rows of the batch's grammar masks (`BatchGrammar.part`)."""
    faults = Faults(ForwardMode.EXTEND)
    engine = Engine(ServerArgs(model_preset="tiny", disable_overlap_schedule=True), fault_hook=faults)
    constrained = SamplingParams(max_new_tokens=12, temperature=0, regex="(yes|no)-[0-9]{3}")
    try:
        assert engine.ready.wait(60)
        [alone] = engine.generate(BATCH[0], constrained)
        faults.bad_ids = engine.tokenize(BATCH[BAD])
        good, bad = engine.generate(BATCH[:2], constrained)
        assert [engine.tokenize(p) for p in BATCH[:2]] in faults.extends  # one prefill batch
        assert bad.finish_reason is FinishReason.ERROR
        assert good.token_ids == alone.token_ids and re.fullmatch("(yes|no)-[0-9]{3}", good.text), good.text
    finally:
        engine.shutdown()
