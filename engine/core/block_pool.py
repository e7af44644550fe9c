"""The KV block pool: the single KV accounting of the engine.

Capacity is ``kv_capacity_tokens`` split into fixed-size blocks. A request holds a list of
block ids (its block table); the real executor stores its keys and values at those block ids.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat

from tidegate.engine.core.request import Request

_popleft = deque.popleft


class BlockPool:
    """Fixed-size KV blocks handed out to requests and taken back on any exit.

    :param kv_capacity_tokens: total KV capacity M in tokens (rounded down to whole blocks).
    :param block_size: tokens per block.
    """

    def __init__(self, kv_capacity_tokens: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be a positive number of tokens, got {block_size}")
        if kv_capacity_tokens < block_size:
            raise ValueError(
                f"KV capacity of {kv_capacity_tokens} tokens is smaller than one block of {block_size}")
        self.block_size = block_size
        self.num_blocks = kv_capacity_tokens // block_size
        self.capacity_tokens = self.num_blocks * block_size
        self._free: deque[int] = deque(range(self.num_blocks))
        #: KV usage in tokens, counted in whole blocks (what the cache really holds back); kept
        #: current by every change, since the engine reads it several times a step
        self.used_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Blocks ``request`` must still get so that it can hold ``num_tokens`` tokens."""
        need = -(-num_tokens // self.block_size) - len(request.block_ids)
        return need if need > 0 else 0

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Give ``request`` enough blocks to hold ``num_tokens``; False (and nothing taken) if short."""
        need = -(-num_tokens // self.block_size) - len(request.block_ids)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        request.block_ids.extend(map(_popleft, repeat(self._free, need)))
        self.used_tokens += need * self.block_size
        return True

    def add_one_block(self, requests: list[Request]) -> None:
        """Give each of ``requests`` one more block, in order; the caller has made sure that
        enough are free (a decode whose new token starts a block needs exactly one)."""
        if len(requests) > len(self._free):
            raise ValueError(f"{len(requests)} blocks asked for, {len(self._free)} free")
        take = self._free.popleft
        for r in requests:
            r.block_ids.append(take())
        self.used_tokens += len(requests) * self.block_size

    def free(self, request: Request) -> None:
        """Return all of ``request``'s blocks to the pool."""
        if request.block_ids:
            self._free.extend(request.block_ids)
            self.used_tokens -= len(request.block_ids) * self.block_size
            request.block_ids = []
