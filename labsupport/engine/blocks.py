"""Paged KV memory, the bookkeeping half: which fixed-size block of the pool holds which tokens.

The pool is cut into ``num_blocks`` blocks of ``block_size`` token slots. A sequence owns a
*block table*, the list of its blocks in order, so token ``p`` of the sequence lives in slot
``table[p // block_size] * block_size + p % block_size``. Blocks need not be contiguous, so no
sequence reserves memory for tokens it may never generate: the only waste is the unused tail of
each sequence's last block.

Reference counts let blocks be shared (chapter 03's prefix cache); a block returns to the free
list when its count drops to zero. Freeing a free block is a bug that would hand the same
memory to two sequences, so it raises. The free list is kept in the order blocks were freed:
``allocate`` takes the least recently freed, so a freed block that still holds cached KV
(chapter 03) survives as long as possible and ``take`` can pull it back out on a cache hit.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .prefix_cache import CPUTier, PrefixCache, chain_hashes, longest_prefix


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_blocks)

    def allocate(self) -> int:
        if not self.free_blocks:
            raise MemoryError("no free KV blocks")
        block, _ = self.free_blocks.popitem(last=False)
        self.ref_counts[block] = 1
        return block

    def take(self, block: int):
        """Reuse this particular free block (it holds KV a new request can use)."""
        del self.free_blocks[block]
        self.ref_counts[block] = 1

    def share(self, block: int):
        """Another sequence uses this block too."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is free; it cannot be shared")
        self.ref_counts[block] += 1

    def free(self, block: int):
        if self.ref_counts[block] <= 0:
            raise ValueError(f"double free of block {block}")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def slot_mapping(block_table: list[int], start: int, n: int, block_size: int) -> list[int]:
    """Pool slots of tokens ``start .. start + n - 1`` of a sequence with this block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


@dataclass
class PrefixHit:
    """What a request can reuse: cached device blocks, then blocks to copy back from the CPU tier."""

    device_blocks: list[int] = field(default_factory=list)
    cpu_hashes: list[bytes] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)

    def num_blocks(self) -> int:
        return len(self.device_blocks) + len(self.cpu_hashes)


class KVCacheManager:
    """Gives each request the blocks its tokens need, and takes them back when it leaves.

    The scheduler (policy) asks ``can_allocate`` before admitting or extending a request; the
    attention backend (mechanism) only reads ``request.block_table``. With prefix caching, a new
    request first reuses the longest chain of cached full blocks (``match``/``admit``), and every
    block that fills up is registered (``cache_full_blocks``) for the requests after it.
    """

    def __init__(self, num_blocks: int, block_size: int, allocator: BlockAllocator | None = None,
                 enable_prefix_caching: bool = False, cpu_tier: CPUTier | None = None):
        self.block_size = block_size
        self.allocator = allocator or BlockAllocator(num_blocks)
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.cpu_tier = cpu_tier
        self.tables: dict[str, object] = {}  # request_id -> request, for snapshots
        self.counters = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "cpu_tier_hits": 0}
        # chapter 03's exercise plugs the attendee's own versions of these two in here
        self.chain_hashes = chain_hashes
        self.longest_prefix = longest_prefix

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def num_new_blocks(self, req, num_new_tokens: int) -> int:
        return max(0, blocks_needed(req.num_computed_tokens + num_new_tokens, self.block_size) - len(req.block_table))

    def can_allocate(self, req, num_new_tokens: int) -> bool:
        return self.allocator.can_allocate(self.num_new_blocks(req, num_new_tokens))

    def _new_block(self) -> int:
        block = self.allocator.allocate()
        if self.prefix_cache is not None:
            evicted = self.prefix_cache.evict(block)  # its old contents are about to be overwritten
            if evicted is not None and self.cpu_tier is not None:
                self.cpu_tier.save(*evicted, block)
        return block

    def allocate(self, req, num_new_tokens: int):
        for _ in range(self.num_new_blocks(req, num_new_tokens)):
            req.block_table.append(self._new_block())
        self.tables[req.request_id] = req

    def free(self, req):
        for block in reversed(req.block_table):  # tail first: the shared prefix stays cached longest
            self.allocator.free(block)
        req.block_table = []
        req.block_hashes = []
        self.tables.pop(req.request_id, None)

    # ------------------------------------------------------------------ prefix caching

    def match(self, req) -> PrefixHit:
        """The longest chain of cached full blocks at the start of the request (no state changes).
        At least one token is left to compute: its logits give the next token."""
        hit = PrefixHit()
        if self.prefix_cache is None:
            return hit
        tokens, bs = req.all_token_ids, self.block_size
        hashes = self.chain_hashes(tokens[:(len(tokens) - 1) // bs * bs], bs, req.cache_salt)

        def chunk(i):
            return tuple(tokens[i * bs:(i + 1) * bs])

        hit.device_blocks = self.longest_prefix(hashes, lambda i, h: self.prefix_cache.lookup(h, chunk(i)))
        done = len(hit.device_blocks)
        if self.cpu_tier is not None:  # the chain may go on in host memory
            rest = self.longest_prefix(hashes[done:], lambda i, h: h if self.cpu_tier.contains(h, chunk(done + i))
                                       else None)
            hit.cpu_hashes = list(rest)
        hit.hashes = hashes[:hit.num_blocks()]
        return hit

    def can_admit(self, req, hit: PrefixHit) -> bool:
        live = sum(1 for b in hit.device_blocks if self.allocator.ref_counts[b] > 0)  # shared, not taken
        return self.allocator.can_allocate(blocks_needed(req.num_tokens, self.block_size) - live)

    def admit(self, req, hit: PrefixHit):
        """Reuse the hit: share live blocks, take cached free ones, copy CPU-tier ones back."""
        for block in hit.device_blocks:
            if self.allocator.ref_counts[block] > 0:
                self.allocator.share(block)
            else:
                self.allocator.take(block)
            req.block_table.append(block)
        reused = len(hit.device_blocks)
        for h in hit.cpu_hashes:
            self.cpu_tier.touch(h)  # most recently used: our own evictions below must not push them out
        for h in hit.cpu_hashes:
            block = self._new_block()
            if not self.cpu_tier.has(h):  # pushed out anyway (a tiny CPU tier): compute the rest
                self.allocator.free(block)
                break
            self.cpu_tier.load(h, block)
            self.prefix_cache.insert(block, h, tuple(req.all_token_ids[reused * self.block_size:
                                                                       (reused + 1) * self.block_size]))
            req.block_table.append(block)
            reused += 1
        req.block_hashes = list(hit.hashes[:reused])
        req.num_computed_tokens = reused * self.block_size
        self.counters["prefix_cache_queries"] += req.num_tokens
        self.counters["prefix_cache_hits"] += req.num_computed_tokens
        self.counters["cpu_tier_hits"] += reused - len(hit.device_blocks)
        self.tables[req.request_id] = req

    def cache_full_blocks(self, req):
        """Register the request's newly filled blocks so later requests can reuse them."""
        if self.prefix_cache is None:
            return
        bs = self.block_size
        full = req.num_computed_tokens // bs
        if full <= len(req.block_hashes):
            return
        tokens = req.all_token_ids[:full * bs]
        hashes = self.chain_hashes(tokens, bs, req.cache_salt)
        for i in range(len(req.block_hashes), full):
            self.prefix_cache.insert(req.block_table[i], hashes[i], tuple(tokens[i * bs:(i + 1) * bs]))
        req.block_hashes = hashes

    def snapshot(self) -> dict:
        """The pool as the block-map widget draws it."""
        n, bs = self.num_blocks, self.block_size
        owners, tokens = [[] for _ in range(n)], [0] * n
        for rid, req in self.tables.items():
            for i, block in enumerate(req.block_table):
                owners[block].append(rid)
                tokens[block] = max(tokens[block], min(bs, req.num_tokens - i * bs))
        cached = [bool(self.prefix_cache and self.prefix_cache.is_cached(b)) and not owners[b] for b in range(n)]
        return {"block_size": bs, "owners": owners, "ref_counts": list(self.allocator.ref_counts), "tokens": tokens,
                "cached": cached}
