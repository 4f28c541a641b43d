import random

import pytest

from plugserve.core.kv_cache import OutOfPagesError, PageAllocator
from plugserve.runtime.radix_cache import PrefixMatch, RadixCache

PAGE_SIZES = [1, 4]


class _TrackingAllocator(PageAllocator):
    """Records freed pages, so tests see exactly what the cache gave back."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self.freed: list[int] = []

    def free(self, pages: list[int]) -> None:
        super().free(pages)
        self.freed.extend(pages)


def _cache(page_size: int, num_pages: int = 32, enabled: bool = True) -> tuple[RadixCache, _TrackingAllocator]:
    allocator = _TrackingAllocator(num_pages)
    return RadixCache(allocator, page_size, enabled), allocator


def _seq(page_size: int, *pages: int) -> list[int]:
    """Tokens of whole pages, page i filled with token `pages[i]`."""
    return [t for t in pages for _ in range(page_size)]


def _insert(cache: RadixCache, tokens: list[int]) -> PrefixMatch:
    """Insert `tokens` (whole pages) with freshly allocated pages, as a request that matched nothing would."""
    return cache.insert(tokens, cache.allocator.alloc(len(tokens) // cache.page_size))


def _extend(cache: RadixCache, tokens: list[int]) -> PrefixMatch:
    """Insert `tokens` (whole pages) reusing the cached prefix's pages, as a request that matched it would."""
    cached = cache.match_prefix(tokens).pages
    return cache.insert(tokens, [*cached, *cache.allocator.alloc(len(tokens) // cache.page_size - len(cached))])


def _conserved(cache: RadixCache, owned: int = 0) -> bool:
    return cache.allocator.num_free + cache.cached_pages + owned == cache.allocator.num_pages


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_empty_cache_matches_nothing(page_size):
    cache, _ = _cache(page_size)
    match = cache.match_prefix(_seq(page_size, 1, 2, 3))
    assert (match.pages, match.num_tokens) == ([], 0)
    assert cache.cached_pages == cache.evictable_pages == cache.protected_pages == 0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_match_full_and_partial_prefixes_of_whole_pages(page_size):
    cache, allocator = _cache(page_size)
    tokens = list(range(3 * page_size))
    pages = allocator.alloc(3)
    inserted = cache.insert(tokens, pages)
    assert (inserted.pages, inserted.num_tokens) == (pages, 3 * page_size)
    assert cache.match_prefix(tokens).pages == pages
    assert cache.match_prefix([*tokens, 99, 98]).pages == pages  # longer query: the cached part
    # One token past two pages: a third page is only whole at page_size 1.
    partial = cache.match_prefix(tokens[: 2 * page_size + 1])
    assert partial.pages == pages[: (2 * page_size + 1) // page_size]
    assert partial.num_tokens == len(partial.pages) * page_size
    # A token differing inside the second page cuts the match at the first page.
    assert cache.match_prefix([*tokens[:page_size], -1, *tokens[page_size + 1 :]]).pages == pages[:1]
    assert cache.match_prefix([-1, *tokens[1:]]).pages == []
    assert cache.cached_pages == 3 and _conserved(cache)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_shared_prefix_splits_the_edge_and_both_sequences_match(page_size):
    cache, allocator = _cache(page_size)
    a = _seq(page_size, 1, 2, 3)
    b = [*_seq(page_size, 1, 2), *_seq(page_size, 3)[:-1], 4]  # differs in the last token of page 3
    pages_a, pages_b = allocator.alloc(3), allocator.alloc(3)
    cache.insert(a, pages_a)
    allocator.freed.clear()
    match_b = cache.insert(b, pages_b)
    assert match_b.pages == [*pages_a[:2], pages_b[2]]  # the cached shared pages win
    assert allocator.freed == pages_b[:2]
    node_a, node_b = cache.match_prefix(a).node, cache.match_prefix(b).node
    assert node_a is not node_b and node_a.parent is node_b.parent is cache.match_prefix(a[: 2 * page_size]).node
    assert cache.match_prefix(a).pages == pages_a and cache.match_prefix(b).pages == match_b.pages
    assert cache.match_prefix(a[: 2 * page_size]).pages == pages_a[:2]
    assert cache.cached_pages == 4 and _conserved(cache)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_duplicate_insert_frees_the_duplicate_pages_but_keeps_matched_ones(page_size):
    cache, allocator = _cache(page_size)
    tokens = _seq(page_size, 5, 6)
    original = _insert(cache, tokens).pages
    duplicate = allocator.alloc(2)
    assert _conserved(cache, owned=2)
    allocator.freed.clear()
    assert cache.insert(tokens, duplicate).pages == original
    assert sorted(allocator.freed) == sorted(duplicate) and _conserved(cache)
    # A request that reused the cached pages and extended them hands all of its pages back.
    longer = [*tokens, *_seq(page_size, 7)]
    allocator.freed.clear()
    match = _extend(cache, longer)
    assert allocator.freed == [] and match.pages[:2] == original
    assert cache.cached_pages == 3 and _conserved(cache)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_locked_paths_survive_eviction(page_size):
    cache, allocator = _cache(page_size)
    a, b = _seq(page_size, 1, 2, 3), _seq(page_size, 1, 2, 4, 5)
    _insert(cache, a)
    _extend(cache, b)
    node = cache.match_prefix(a).node
    cache.lock(node)
    cache.lock(node)  # two requests on the same prefix
    assert (cache.protected_pages, cache.evictable_pages) == (3, 2)
    assert cache.evict(10) == 2  # only b's own pages
    assert cache.match_prefix(a).num_tokens == len(a) and cache.match_prefix(b).num_tokens == 2 * page_size
    cache.unlock(node)
    assert cache.evict(10) == 0
    cache.unlock(node)
    assert (cache.protected_pages, cache.evictable_pages) == (0, 3)
    assert cache.evict(10) == 3 and cache.cached_pages == 0 and allocator.num_free == allocator.num_pages


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_splitting_a_locked_edge_keeps_it_protected(page_size):
    cache, _ = _cache(page_size)
    a = _seq(page_size, 1, 2, 3)
    node = _insert(cache, a).node
    cache.lock(node)
    _insert(cache, _seq(page_size, 1, 9))  # splits a's edge after its first page
    assert (cache.protected_pages, cache.evictable_pages) == (3, 1)
    cache.unlock(node)
    assert (cache.protected_pages, cache.evictable_pages) == (0, 4)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_eviction_takes_least_recently_used_leaves_first(page_size):
    cache, _ = _cache(page_size)
    a, b, c = _seq(page_size, 1, 1), _seq(page_size, 2, 2), _seq(page_size, 3, 3)
    for tokens in (a, b, c):
        _insert(cache, tokens)
    cache.match_prefix(a)  # a is now the most recent, b the least
    assert cache.evict(2) == 2
    assert [cache.match_prefix(t).num_tokens for t in (a, b, c)] == [2 * page_size, 0, 2 * page_size]
    cache.match_prefix(a)
    assert cache.evict(1) == 1  # only c's tail page: its head stays cached
    assert [cache.match_prefix(t).num_tokens for t in (a, c)] == [2 * page_size, page_size]
    assert cache.cached_pages == 3 and _conserved(cache)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_parent_becomes_evictable_once_its_children_are_gone(page_size):
    cache, allocator = _cache(page_size)
    prefix = _seq(page_size, 1, 2)
    for last in (3, 4):
        _extend(cache, [*prefix, *_seq(page_size, last)])
    assert cache.evict(2) == 2  # the two leaves: their parent is no leaf until both are gone
    assert cache.match_prefix([*prefix, *_seq(page_size, 3)]).num_tokens == 2 * page_size
    assert cache.evict(5) == 2 and cache.evict(1) == 0
    assert cache.cached_pages == 0 and allocator.num_free == allocator.num_pages


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_evicts_when_the_pool_is_short(page_size):
    cache, allocator = _cache(page_size, num_pages=4)
    a, b = _seq(page_size, 1, 1), _seq(page_size, 2, 2)
    _insert(cache, a)
    _insert(cache, b)
    assert allocator.num_free == 0
    cache.match_prefix(b)
    pages = cache.alloc(1)
    assert len(pages) == 1 and cache.cached_pages == 3
    assert cache.match_prefix(a).num_tokens == page_size  # a, the older, lost its tail page
    cache.lock(cache.match_prefix(b).node)
    with pytest.raises(OutOfPagesError):
        cache.alloc(3)  # a's last page can go, b's two are locked
    assert cache.cached_pages == 2 and _conserved(cache, owned=1)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_disabled_cache_never_matches_and_frees_inserted_pages(page_size):
    cache, allocator = _cache(page_size, enabled=False)
    tokens = _seq(page_size, 1, 2)
    match = _insert(cache, tokens)
    assert (match.pages, match.num_tokens) == ([], 0)
    assert allocator.num_free == allocator.num_pages and cache.cached_pages == 0
    assert cache.match_prefix(tokens).num_tokens == 0
    cache.lock(match.node)
    cache.unlock(match.node)
    assert cache.evict(5) == 0 and cache.hit_rate == 0.0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_hit_rate_counts_queried_and_matched_tokens(page_size):
    cache, _ = _cache(page_size)
    assert cache.hit_rate == 0.0
    tokens = _seq(page_size, 1, 2)
    cache.match_prefix(tokens)
    _insert(cache, tokens)
    cache.match_prefix([*tokens, 3])
    assert (cache.queried_tokens, cache.hit_tokens) == (4 * page_size + 1, 2 * page_size)
    assert cache.hit_rate == pytest.approx(2 * page_size / (4 * page_size + 1))


def test_insert_rejects_tokens_that_do_not_fill_the_pages():
    cache, allocator = _cache(4)
    with pytest.raises(ValueError, match="do not fill"):
        cache.insert([1, 2, 3, 4, 5], allocator.alloc(1))


def test_reset_drops_everything_unlocked():
    cache, allocator = _cache(2)
    kept = _insert(cache, [1, 1, 2, 2]).node
    _insert(cache, [1, 1, 3, 3])
    _insert(cache, [4, 4])
    cache.lock(kept)
    cache.reset()
    assert (cache.cached_pages, cache.protected_pages) == (2, 2)
    cache.unlock(kept)
    cache.reset()
    assert cache.cached_pages == 0 and allocator.num_free == allocator.num_pages


def _expected_pages(model: dict[tuple[int, ...], int], tokens: list[int], page_size: int) -> list[int]:
    pages = []
    while (end := (len(pages) + 1) * page_size) <= len(tokens) and tuple(tokens[:end]) in model:
        pages.append(model[tuple(tokens[:end])])
    return pages


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_agree_with_a_brute_force_model(page_size, seed):
    """The model maps every cached whole-page prefix to the page holding its last page of KV."""
    rng = random.Random(seed)
    cache, allocator = _cache(page_size, num_pages=16)  # small: alloc() must evict, and sometimes fails
    model: dict[tuple[int, ...], int] = {}
    locks: list[tuple[object, list[int]]] = []  # (node, matched tokens)
    stems = [[rng.randrange(2) for _ in range(4 * page_size)] for _ in range(3)]

    def forget_freed(expect: int) -> None:
        """Drop from the model the prefixes whose pages the cache just evicted."""
        freed = set(allocator.freed)
        gone = [k for k, p in model.items() if p in freed]
        assert len(gone) == len(freed) == expect
        for key in gone:
            del model[key]
        allocator.freed.clear()

    for _ in range(400):
        stem = rng.choice(stems)
        tokens = stem[: rng.randint(0, len(stem))] + [rng.randrange(2) for _ in range(rng.randint(0, 3 * page_size))]
        op = rng.random()
        if op < 0.3:
            match = cache.match_prefix(tokens)
            assert match.pages == _expected_pages(model, tokens, page_size)
            assert match.num_tokens == len(match.pages) * page_size
            if rng.random() < 0.5:
                cache.lock(match.node)
                locks.append((match.node, tokens[: match.num_tokens]))
        elif op < 0.7:
            whole = tokens[: len(tokens) // page_size * page_size]
            match = cache.match_prefix(whole)
            cache.lock(match.node)  # as a request does, so that alloc() cannot evict what it reuses
            reused = match.pages if rng.random() < 0.7 else []
            evictable, free = cache.evictable_pages, allocator.num_free
            need = len(whole) // page_size - len(reused)
            try:
                pages = reused + cache.alloc(need)
            except OutOfPagesError:
                assert free + evictable < need
                forget_freed(evictable)
                cache.unlock(match.node)
                continue
            forget_freed(max(0, need - free))  # alloc() evicts just the shortfall
            duplicates = []
            for i, page in enumerate(pages):
                key = tuple(whole[: (i + 1) * page_size])
                if key not in model:
                    model[key] = page
                elif model[key] != page:
                    duplicates.append(page)
            inserted = cache.insert(whole, pages)
            cache.unlock(match.node)
            assert allocator.freed == duplicates
            allocator.freed.clear()
            assert inserted.pages == _expected_pages(model, whole, page_size)
            assert inserted.num_tokens == len(whole)
        elif op < 0.9:
            want, evictable = rng.randint(0, 6), cache.evictable_pages
            assert cache.evict(want) == min(want, evictable)
            forget_freed(min(want, evictable))
            assert all(key[:-page_size] in model for key in model if len(key) > page_size)
        elif locks:
            node, _ = locks.pop(rng.randrange(len(locks)))
            cache.unlock(node)

        locked = {tuple(t[:end]) for _, t in locks for end in range(page_size, len(t) + 1, page_size)}
        assert locked <= model.keys()
        assert (cache.protected_pages, cache.cached_pages) == (len(locked), len(model))
        assert allocator.num_free + len(model) == allocator.num_pages

    for node, _ in locks:
        cache.unlock(node)
    cache.reset()
    assert cache.cached_pages == 0 and allocator.num_free == allocator.num_pages


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_cached_prefix_len_agrees_with_match_prefix_and_changes_nothing(page_size):
    cache, _ = _cache(page_size)
    _insert(cache, _seq(page_size, 1, 2, 3))
    _insert(cache, _seq(page_size, 1, 2, 5, 6))
    for query in ([1, 2, 3, 4], [1, 2, 5], [1, 9], [7], [1, 2, 5, 6, 8]):
        tokens = _seq(page_size, *query) + [0] * (page_size - 1)  # a trailing partial page never matches
        stats, nodes = (cache.hit_tokens, cache.queried_tokens), len(cache._nodes())
        length = cache.cached_prefix_len(tokens)
        assert ((cache.hit_tokens, cache.queried_tokens), len(cache._nodes())) == (stats, nodes)
        assert length == cache.match_prefix(tokens).num_tokens
    assert _cache(page_size, enabled=False)[0].cached_prefix_len(_seq(page_size, 1)) == 0
