"""The KV block pool: the single KV accounting of the engine, and its prefix cache.

Capacity is ``kv_capacity_tokens`` split into fixed-size blocks. A request holds a list of
block ids (its block table); the real executor stores its keys and values at those block ids.

With prefix caching (vLLM's automatic prefix caching), a full block of a prompt whose KV has been
computed is registered under its hash (``engine.core.prefix``: chained over the blocks before it).
A request whose leading blocks hash the same takes those blocks instead of computing them again,
and a block held by several requests counts once. A freed registered block keeps its content and
hash, and is handed out again only when no never-registered block is free: the least recently
freed first, and a request's last blocks before its first, so a shared head stays longest.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import repeat, takewhile

from tidegate.engine.core.request import Request

_popleft = deque.popleft


def _is_block(b: int | None) -> bool:
    return b is not None


class BlockPool:
    """Fixed-size KV blocks handed out to requests and taken back on any exit.

    :param kv_capacity_tokens: total KV capacity M in tokens (rounded down to whole blocks).
    :param block_size: tokens per block.
    :param prefix_caching: keep computed prompt blocks for reuse by their hash.
    """

    def __init__(self, kv_capacity_tokens: int, block_size: int = 16, prefix_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be a positive number of tokens, got {block_size}")
        if kv_capacity_tokens < block_size:
            raise ValueError(
                f"KV capacity of {kv_capacity_tokens} tokens is smaller than one block of {block_size}")
        self.block_size = block_size
        self.num_blocks = kv_capacity_tokens // block_size
        self.capacity_tokens = self.num_blocks * block_size
        self.prefix_caching = prefix_caching
        #: free blocks that hold nothing registered
        self._free: deque[int] = deque(range(self.num_blocks))
        #: KV usage in tokens, counted in whole blocks held by at least one request (what the cache
        #: really holds back); kept current by every change, since the engine reads it several times a step
        self.used_tokens = 0
        #: hash -> the registered block that holds it
        self._cached: dict[int, int] = {}
        #: registered block -> its hash
        self._hash_of: dict[int, int] = {}
        #: registered block -> how many requests hold it (0: free, in ``_evictable``)
        self._refs: dict[int, int] = {}
        #: registered blocks no request holds, least recently freed first
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, held or free: what a request's prefix may hit."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Blocks ``request`` must still get so that it can hold ``num_tokens`` tokens."""
        need = -(-num_tokens // self.block_size) - len(request.block_ids)
        return need if need > 0 else 0

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free) + len(self._evictable)

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Give ``request`` enough blocks to hold ``num_tokens``; False (and nothing taken) if short."""
        need = -(-num_tokens // self.block_size) - len(request.block_ids)
        if need <= 0:
            return True
        free = self._free
        if need > len(free):
            if need > len(free) + len(self._evictable):
                return False
            self._reclaim(need - len(free))
        request.block_ids.extend(map(_popleft, repeat(free, need)))
        self.used_tokens += need * self.block_size
        return True

    def add_one_block(self, requests: list[Request]) -> None:
        """Give each of ``requests`` one more block, in order; the caller has made sure that
        enough are free (a decode whose new token starts a block needs exactly one)."""
        free = self._free
        if len(requests) > len(free):
            if len(requests) > len(free) + len(self._evictable):
                raise ValueError(f"{len(requests)} blocks asked for, {self.num_free_blocks} free")
            self._reclaim(len(requests) - len(free))
        take = free.popleft
        for r in requests:
            r.block_ids.append(take())
        self.used_tokens += len(requests) * self.block_size

    def free(self, request: Request) -> None:
        """Return all of ``request``'s blocks to the pool; a registered one stays cached until reused."""
        ids = request.block_ids
        if not ids:
            return
        request.block_ids = []
        request.registered_blocks = 0
        if not self._hash_of:
            self._free.extend(ids)
            self.used_tokens -= len(ids) * self.block_size
            return
        hash_of, refs = self._hash_of, self._refs
        registered = [b for b in reversed(ids) if b in hash_of]  # the tail first: the head is likelier shared
        if len(registered) < len(ids):
            self._free.extend([b for b in ids if b not in hash_of])
        released = len(ids) - len(registered)
        evictable = self._evictable
        if max(map(refs.__getitem__, registered), default=1) == 1:  # none shared: all become evictable
            refs.update(dict.fromkeys(registered, 0))
            evictable.update(dict.fromkeys(registered))
            released += len(registered)
        else:
            for b in registered:
                n = refs[b] - 1
                refs[b] = n
                if not n:  # no other request holds it
                    evictable[b] = None
                    released += 1
        self.used_tokens -= released * self.block_size

    # ------------------------------------------------------------------ the prefix cache
    def cached_prefix(self, block_hashes: list[int], max_blocks: int) -> list[int]:
        """The registered blocks that hold the leading ``block_hashes``, at most ``max_blocks``."""
        cached = self._cached
        if not cached:
            return []
        return list(takewhile(_is_block, map(cached.get, block_hashes[:max_blocks])))  # type: ignore[arg-type]

    def blocks_to_start(self, num_tokens: int, hits: list[int]) -> int:
        """The free blocks a request with nothing allocated takes to hold ``num_tokens`` tokens when
        it starts with the cached ``hits``: the blocks it lacks, and the hits no request holds."""
        refs = self._refs
        revived = 0
        for b in hits:
            revived += refs[b] == 0
        return -(-num_tokens // self.block_size) - len(hits) + revived

    def allocate(self, request: Request, num_tokens: int, hits: list[int]) -> bool:
        """Give ``request`` (holding nothing) the cached ``hits`` as its first blocks and new ones up
        to ``num_tokens`` tokens; False (and nothing taken) if the pool is short."""
        if not hits:
            return self.grow(request, num_tokens)
        if self.blocks_to_start(num_tokens, hits) > len(self._free) + len(self._evictable):
            return False
        refs, evictable = self._refs, self._evictable
        revived = 0
        for b in hits:
            n = refs[b]
            if not n:
                del evictable[b]
                revived += 1
            refs[b] = n + 1
        request.block_ids = list(hits)
        request.registered_blocks = len(hits)
        self.used_tokens += revived * self.block_size
        return self.grow(request, num_tokens)

    def register(self, request: Request) -> None:
        """Register ``request``'s full blocks whose KV is now computed under their hashes (prompt
        blocks only: ``request.block_hashes``). A block whose hash another block already holds
        stays a plain one."""
        hashes = request.block_hashes
        if hashes is None:
            return
        done = request.num_computed_tokens // self.block_size
        if done > len(hashes):
            done = len(hashes)
        k = request.registered_blocks
        if k >= done:
            return
        cached = self._cached
        new = {h: b for h, b in zip(hashes[k:done], request.block_ids[k:done]) if h not in cached}
        if new:
            cached.update(new)
            self._hash_of.update(zip(new.values(), new.keys()))
            self._refs.update(dict.fromkeys(new.values(), 1))
        request.registered_blocks = done

    def _reclaim(self, n: int) -> None:
        """Move the ``n`` least recently freed registered blocks to the free list, unregistered."""
        pop = self._evictable.popitem
        taken = [pop(False)[0] for _ in range(n)]
        deque(map(self._cached.__delitem__, map(self._hash_of.pop, taken)), maxlen=0)
        deque(map(self._refs.__delitem__, taken), maxlen=0)
        self._free.extend(taken)
