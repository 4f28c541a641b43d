"""Structured output: a request's JSON schema, regular expression or EBNF grammar compiled by xgrammar into a
token-level matcher, and the token bitmask each step samples its batch under.

The server compiles a request's grammar off the event loop (`GrammarCompiler.compile`, cached by its text), before
the request reaches the scheduler, so that compiling never stalls the scheduler loop; the scheduler gives each
request a fresh matcher, advances it with every token, and ends the request when its grammar terminates.

Under overlap scheduling, step i + 1 is planned before step i's tokens are known, so its mask cannot be filled at
planning. As in SGLang, its forward is launched all the same, and its sampling waits (`BatchGrammar.bitmask`) until
the scheduler thread has processed step i's tokens into the matchers and filled the mask (`BatchGrammar.fill`).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from plugserve.core.host_copy import to_device

if TYPE_CHECKING:
    import xgrammar

    from plugserve.runtime.request import Request
    from plugserve.runtime.sampling import SamplingParams

CACHE_SIZE = 512  # compiled grammars kept (a schema sent again is not compiled again)


class GrammarError(ValueError):
    """A grammar that cannot be compiled or served; `field`: the SamplingParams field it came in."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def grammar_of(params: SamplingParams) -> tuple[str, str] | None:
    """(field, text) of a request's grammar: json_schema, regex or ebnf; None when it has none."""
    for field, text in zip(("json_schema", "regex", "ebnf"), params.grammar, strict=True):
        if text is not None:
            return field, text
    return None


class GrammarCompiler:
    """xgrammar's compiler over the served tokenizer, with compiled grammars cached by their text. Thread-safe: the
    server compiles in worker threads. xgrammar is imported, and the tokenizer's vocabulary read, on first use.
    `vocab_size`: the sampled vocabulary (the tokenizer's tokens, not the model's padding rows past them: xgrammar
    would hold those as special tokens, which its every accept_token scans)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(t for t in stop_token_ids if t < vocab_size)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, field: str, text: str) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `text` given as `field` (json_schema: a JSON schema as a string; regex; ebnf).
        Raises GrammarError naming the field for one xgrammar refuses."""
        key = (field, text)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            compiler = self._compiler or self._start()
        try:
            if field == "json_schema":
                # Compact JSON: free whitespace lets a model pad the output until max_tokens.
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            elif field == "regex":
                compiled = compiler.compile_regex(text)
            else:
                compiled = compiler.compile_grammar(text)
        except Exception as exc:  # xgrammar's refusal of the text, whatever its type: the client's to fix
            raise GrammarError(field, f"{field} could not be compiled: {exc}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _start(self) -> xgrammar.GrammarCompiler:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=self.stop_token_ids)
        self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
        """A fresh matcher of one request (its state: the output so far)."""
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)


class BatchGrammar:
    """The grammar-constrained rows of one batch's sampled requests, and the token bitmask they sample under."""

    def __init__(self, requests: Sequence[Request], vocab_size: int) -> None:
        self.requests, self.vocab_size = list(requests), vocab_size
        self._bitmask: torch.Tensor | None = None
        self._ready = threading.Event()

    @classmethod
    def plan(cls, requests: Sequence[Request], vocab_size: int, unfilled: list[BatchGrammar] | None
             ) -> BatchGrammar | None:
        """The masks of a batch's sampled `requests`, filled now, or put in `unfilled` (not None: the batch in
        flight samples some of their previous tokens) for `fill_all` once it has been processed. None when no
        request is constrained (the batch samples unmasked)."""
        if all(r.grammar is None for r in requests):
            return None
        masks = cls(requests, vocab_size)
        if unfilled is None:
            masks.fill()
        else:
            unfilled.append(masks)
        return masks

    @property
    def filled(self) -> bool:
        return self._ready.is_set()

    def fill(self) -> None:
        """Fill the mask from each matcher's state (call once every request's earlier tokens were accepted; a
        finished request's row allows every token: its token is dropped) and release the sampling that waits."""
        if self.filled:
            return
        from xgrammar import allocate_token_bitmask

        bitmask = allocate_token_bitmask(len(self.requests), self.vocab_size)  # [B, ceil(V / 32)] int32, all set
        rows = [row for row, r in enumerate(self.requests)
                if r.grammar is not None and not r.finished and not r.grammar.is_terminated()]
        if rows:  # the rows in parallel on the CPU's cores (xgrammar's threads, the GIL released)
            _batch_matcher().batch_fill_next_token_bitmask([self.requests[row].grammar for row in rows], bitmask,
                                                           rows)
        self._bitmask = bitmask
        self._ready.set()

    def part(self, rows: Sequence[int]) -> BatchGrammar:
        """The masks of the sampled requests at `rows` alone (a failed batch's part re-run on its own), filled once
        these are."""
        self._ready.wait()
        assert self._bitmask is not None
        part = BatchGrammar([self.requests[row] for row in rows], self.vocab_size)
        part._bitmask = self._bitmask[list(rows)]
        part._ready.set()
        return part

    def bitmask(self, device: torch.device) -> torch.Tensor:
        """[B, ceil(V / 32)] int32 on `device`, once filled (the overlap worker waits here for the scheduler)."""
        self._ready.wait()
        assert self._bitmask is not None
        return to_device(self._bitmask, device)


@functools.cache
def _batch_matcher() -> xgrammar.BatchGrammarMatcher:
    from xgrammar import BatchGrammarMatcher

    return BatchGrammarMatcher()


def fill_all(unfilled: list[BatchGrammar]) -> None:
    """Fill the masks planned before the batch just processed (or failed) was known, and forget them."""
    for masks in unfilled:
        masks.fill()
    unfilled.clear()


def accept(request: Request, token: int) -> bool:
    """Advance the request's matcher by `token`; True when its grammar has now terminated (the output is whole)."""
    matcher = request.grammar
    if matcher is None:
        return False
    if not matcher.accept_token(token):
        raise RuntimeError(f"token {token} broke the request's grammar")
    return matcher.is_terminated()
