"""Prefix cache: a radix tree over token ids whose edges own whole KV pages, so requests sharing a prompt
prefix reuse its pages instead of recomputing them (SGLang's paged radix cache; token-granular at page_size 1)."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from plugserve.core.kv_cache import OutOfPagesError, PageAllocator, PoolAccountingError


class _Node:
    """An edge and the node it leads to: `key` (a multiple of page_size tokens) and the pages holding their KV."""

    __slots__ = ("children", "id", "key", "last_access", "lock_ref", "pages", "parent")

    _ids = itertools.count()

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: _Node | None, last_access: int = 0) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        # Keyed by the child's first page of tokens: siblings always differ there, since edges split at pages.
        self.children: dict[tuple[int, ...], _Node] = {}
        self.lock_ref = 0
        self.last_access = last_access
        self.id = next(_Node._ids)  # breaks LRU ties deterministically


@dataclass(frozen=True)
class PrefixMatch:
    """`pages` hold the KV of the first `num_tokens` tokens; `node` is the handle to lock while they are used."""

    pages: list[int]
    num_tokens: int
    node: _Node = field(repr=False)


class RadixCache:
    """Maps token prefixes (whole pages only) to the pages holding their KV and evicts them LRU under pressure.

    Every cached page is either protected (on the path of a locked node: a running request reads it) or
    evictable. Time is a counter bumped per lookup, not the wall clock, so eviction order is reproducible.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self._root = _Node((), [], None)
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    @property
    def cached_pages(self) -> int:
        return self._evictable + self._protected

    @property
    def hit_rate(self) -> float:
        """Share of the tokens passed to `match_prefix` that were served from the cache."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of `tokens` made of whole pages; marks its path as recently used."""
        self.queried_tokens += len(tokens)
        if not self.enabled:
            return PrefixMatch([], 0, self._root)
        match = self._walk(tuple(tokens[: len(tokens) // self.page_size * self.page_size]))
        self.hit_tokens += match.num_tokens
        return match

    def cached_prefix_len(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` (whole pages) are cached, read only: no statistics, no recency, no split."""
        if not self.enabled:
            return 0
        node, pos = self._root, 0
        whole = tuple(tokens[: len(tokens) // self.page_size * self.page_size])
        while pos < len(whole):
            child = node.children.get(whole[pos : pos + self.page_size])
            if child is None:
                break
            common = self._common_pages(child.key, whole, pos)
            pos += common
            if common < len(child.key):
                break
            node = child
        return pos

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> PrefixMatch:
        """Cache the KV of `tokens` held in `pages` (whole pages: the caller frees a trailing partial one).

        The cache takes ownership of `pages`. Where a prefix is already cached the cached pages win and the
        caller's copies are freed, except pages that are the cached ones (e.g. got from `match_prefix`).
        Returns the match of all of `tokens`: its pages replace the caller's, its node is the one to lock.
        """
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError(f"{len(tokens)} tokens do not fill {len(pages)} pages of {self.page_size}")
        if not self.enabled:
            self.allocator.free(list(pages))
            return PrefixMatch([], 0, self._root)
        tokens = tuple(tokens)
        match = self._walk(tokens)
        self.allocator.free([p for p, c in zip(pages, match.pages, strict=False) if p != c])
        if match.num_tokens == len(tokens):
            return match
        leaf = _Node(tokens[match.num_tokens :], list(pages[len(match.pages) :]), match.node, self._clock)
        match.node.children[leaf.key[: self.page_size]] = leaf
        self._evictable += len(leaf.pages)
        return PrefixMatch(match.pages + leaf.pages, len(tokens), leaf)

    def lock(self, node: _Node) -> None:
        """Protect the path from `node` to the root from eviction until the matching `unlock`."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.pages)
                self._protected += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        """Undo one `lock(node)`; the path becomes evictable once no lock covers it."""
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock without a matching lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.pages)
                self._evictable += len(node.pages)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages, least recently used unlocked leaves first; returns how many were freed.

        A leaf longer than needed loses only its tail pages: its head is a prefix others are likelier to share.
        """
        heap = [(n.last_access, n.id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            node = heapq.heappop(heap)[2]
            take = min(len(node.pages), num_pages - freed)
            self.allocator.free(node.pages[len(node.pages) - take :])
            freed += take
            self._evictable -= take
            if take < len(node.pages):
                node.pages = node.pages[: len(node.pages) - take]
                node.key = node.key[: len(node.pages) * self.page_size]
                break
            parent = node.parent
            del parent.children[node.key[: self.page_size]]
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def alloc(self, n: int) -> list[int]:
        """`allocator.alloc(n)`, evicting cached pages if the pool is short; raises OutOfPagesError if still short."""
        try:
            return self.allocator.alloc(n)
        except OutOfPagesError:
            self.evict(n - self.allocator.num_free)
            return self.allocator.alloc(n)

    def reset(self) -> None:
        """Drop every unlocked page (locked paths stay: running requests still read them)."""
        self.evict(self._evictable)

    def path_pages(self, node: _Node) -> list[int]:
        """The pages on the path from the root to `node`: the KV of the prefix `node` stands for."""
        pages: list[int] = []
        while node.parent is not None:
            pages[:0] = node.pages
            node = node.parent
        return pages

    def check_accounting(self, locked: Sequence[_Node]) -> set[int]:
        """The pages the tree owns, after checking its bookkeeping against `locked`, the nodes its users hold
        locked (one entry per lock). Raises PoolAccountingError: a page in two nodes, an edge whose pages do not
        match its tokens, a lock count no holder explains, a holder's node no longer in the tree, or evictable /
        protected counts that disagree with the tree."""
        expected: Counter[_Node] = Counter()
        for node in locked:
            while node.parent is not None:
                expected[node] += 1
                node = node.parent
        nodes = self._nodes()
        if missing := set(expected) - set(nodes):
            raise PoolAccountingError(f"{len(missing)} locked prefix-cache nodes are no longer in the tree")
        pages: set[int] = set()
        evictable = protected = 0
        for node in nodes:
            if twice := pages.intersection(node.pages):
                raise PoolAccountingError(f"pages {sorted(twice)} are in two prefix-cache nodes")
            if len(node.key) != len(node.pages) * self.page_size or len(set(node.pages)) != len(node.pages):
                raise PoolAccountingError(f"a prefix-cache edge of {len(node.key)} tokens holds pages {node.pages}")
            if node.lock_ref != expected[node]:
                raise PoolAccountingError(f"a prefix-cache node has {node.lock_ref} locks, its users hold "
                                          f"{expected[node]}")
            pages.update(node.pages)
            if node.lock_ref:
                protected += len(node.pages)
            else:
                evictable += len(node.pages)
        if (evictable, protected) != (self._evictable, self._protected):
            raise PoolAccountingError(f"the prefix cache counts {self._evictable} evictable / {self._protected} "
                                      f"protected pages, its tree has {evictable} / {protected}")
        return pages

    def _walk(self, tokens: tuple[int, ...]) -> PrefixMatch:
        """Match whole-page `tokens` down the tree, splitting the last edge so that the match ends on a node."""
        self._clock += 1
        node, pos, pages = self._root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + self.page_size])
            if child is None:
                break
            common = self._common_pages(child.key, tokens, pos)
            if common < len(child.key):
                # The match ends inside this edge: cut it there so that it ends on a node one can lock.
                child = self._split(child, common)
            child.last_access = self._clock
            pages += child.pages
            node, pos = child, pos + common
        return PrefixMatch(pages, pos, node)

    def _common_pages(self, key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
        """Length of the common prefix of `key` and `tokens[start:]`, rounded down to whole pages."""
        limit = min(len(key), len(tokens) - start)
        n = 0
        while n < limit and key[n] == tokens[start + n]:
            n += 1
        return n // self.page_size * self.page_size

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` tokens; the new upper node is returned, `child` keeps the lower part
        so handles to it (and its locks) stay valid."""
        upper = _Node(child.key[:at], child.pages[: at // self.page_size], child.parent, child.last_access)
        upper.lock_ref = child.lock_ref  # a lock on child covers its whole path, this part included
        upper.parent.children[upper.key[: self.page_size]] = upper
        child.key, child.pages, child.parent = child.key[at:], child.pages[at // self.page_size :], upper
        upper.children[child.key[: self.page_size]] = child
        return upper

    def _nodes(self) -> list[_Node]:
        nodes, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes
