"""Block hashes of a prompt: what the prefix cache (``BlockPool``) matches requests by.

Block ``k`` of a prompt covers its tokens ``[k b, (k + 1) b)`` (``b`` the block size); its hash is
chained over the hash of block ``k - 1``, so two prompts share block ``k``'s hash only if they
share every token up to its end. Only full blocks get one.

- A real request's hashes come from its token ids, with SHA-256 as vLLM hashes by default: a
  client who can choose prompts must not be able to make two different prefixes collide and read
  another's cached keys and values. A ``cache_salt`` goes into the first block's hash, so requests
  with different salts share nothing.
- A simulated request has no token ids. A trace in the Mooncake format says which prompts share
  content by ``hash_ids``, one id for each run of ``block_tokens`` prompt tokens, equal ids for equal
  content and a prompt's ids in order. Block ``k`` then gets a hash chained over the ids of the runs
  its tokens lie in, so it is shared exactly when every id up to its last token's run is; the block
  sizes of the trace and of the engine need not match.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from itertools import accumulate

#: the hash a chain starts from
_ROOT = 0


def token_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                       known: Sequence[int] = ()) -> list[int]:
    """The chained SHA-256 hashes (as 128-bit integers) of the full blocks of ``token_ids``.

    :param known: the hashes of its first blocks, already made (with the same salt): the chain goes on
        from them instead of hashing those blocks again.
    """
    hashes = list(known)
    if known:
        prev = known[-1].to_bytes(16, "little")
    else:
        prev = hashlib.sha256(b"" if cache_salt is None else cache_salt.encode()).digest()[:16]
    for start in range(len(known) * block_size, len(token_ids) - block_size + 1, block_size):
        block = array("q", token_ids[start:start + block_size])
        prev = hashlib.sha256(prev + block.tobytes()).digest()[:16]
        hashes.append(int.from_bytes(prev, "little"))
    return hashes


def content_block_hashes(content_ids: Sequence[int], block_tokens: float, prompt_len: int,
                         block_size: int) -> list[int]:
    """The chained hashes of the full blocks of a ``prompt_len``-token prompt described by content
    ids, each for ``block_tokens`` tokens (a Mooncake trace's ``hash_ids``); a block that ends past
    the runs the ids describe gets none, and ends the chain."""
    hashes: list[int] = []
    if block_tokens <= 0:
        return hashes
    n_blocks = prompt_len // block_size
    per_run = block_tokens / block_size
    if per_run == int(per_run):  # whole blocks to a run (Mooncake's 512 tokens on 16-token blocks)
        # the runs' own chain, then each block of a run named by the run's hash and its place in it
        runs = min(len(content_ids), -(-n_blocks // int(per_run)))
        run_hashes = list(accumulate(content_ids[:runs], lambda h, c: hash((h, c)), initial=_ROOT))[1:]
        per = int(per_run)
        return [hash((run_hashes[k // per], k)) for k in range(min(n_blocks, runs * per))]
    prev = _ROOT
    n_ids = len(content_ids)
    first = 0  # the first run of block k
    for k in range(n_blocks):
        last = int(((k + 1) * block_size - 1) // block_tokens)
        if last >= n_ids:
            break
        prev = hash((prev, *content_ids[first:last + 1]))
        hashes.append(prev)
        first = int((k + 1) * block_size // block_tokens)
    return hashes
