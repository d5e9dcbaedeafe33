"""KV managers: who holds the KV memory of which request, and whether a request fits.

The scheduler (policy) always holds one and asks it the same questions whatever the backend:
is there a cached prefix for this request, is there room for ``n`` more of its tokens, reserve
them, the request left. The attention backend (mechanism) only reads what the manager set up.

* ``KVManager`` keeps nothing (chapter 00's recompute backend): every token is computed again
  each step, so everything always "fits" and nothing is freed.
* ``ContiguousKVManager`` (chapter 01) reserves one tensor per request and layer for the longest
  the request may become, and frees it when the request leaves.
* ``KVCacheManager`` (chapters 02-03) gives each request the blocks its tokens need from one
  shared pool. With prefix caching a new request first reuses the longest chain of cached full
  blocks, and every block that fills up is registered for the requests after it.

No manager writes a request's ``num_computed_tokens``: ``use_cached_prefix`` returns how many
tokens it reused, and the lifecycle (``RequestLifecycle.mark_running``), the one writer of a request's
state, records it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .block_pool import (BlockAllocator, blocks_needed, copy_on_write, fork_blocks, free_blocks_needed,
                         hold_prefix_blocks, release_blocks)
from .plug_points import PlugPoint
from .prefix_cache import CPUTier, PrefixCache, chain_hashes, longest_prefix


@dataclass
class PrefixHit:
    """What a request can reuse: cached device blocks, then blocks to copy back from the CPU tier."""

    device_blocks: list[int] = field(default_factory=list)
    cpu_hashes: list[bytes] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    block_size: int = 0

    @property
    def num_tokens(self) -> int:
        return (len(self.device_blocks) + len(self.cpu_hashes)) * self.block_size


class KVManager:
    """No KV cache: nothing is kept between steps, so every request always fits."""

    keeps_kv = False  # do computed tokens stay computed after the step?
    PLUG_POINTS: dict = {}  # no piece of it is an exercise's (KVCacheManager declares its own)
    capacity = float("inf")  # the most tokens one request can hold: it finishes ("length") there

    def find_cached_prefix(self, req) -> PrefixHit:
        return PrefixHit()

    def can_allocate(self, req, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        return True

    def use_cached_prefix(self, req, hit: PrefixHit) -> int:
        """Take the hit's blocks for ``req``; returns the number of tokens reused."""
        return 0

    def allocate(self, req, num_new_tokens: int):
        """Reserve room for ``num_new_tokens`` more tokens of ``req``."""

    def release(self, req):
        """The request left or was preempted: give back all it holds."""

    def cache_full_blocks(self, req, num_tokens: int | None = None):
        """Offer the request's full blocks up to ``num_tokens`` (default: the computed ones) to other
        requests (prefix caching)."""

    def trim(self, req):
        """Give back room past the request's tokens (rejected guesses of speculative decoding, chapter 09)."""

    def fork(self, parent, child):
        """``child`` (a sample of ``parent``, chapter 04) starts from the parent's KV."""
        raise ValueError("parallel samples (n > 1) need kv_cache='paged': they share the prompt's blocks")

    def stats(self) -> dict:
        return {}


class ContiguousKVManager(KVManager):
    """One contiguous K/V tensor per request and layer, reserved for the request's longest possible
    length (prompt + max_tokens) when it first runs. ``reserved_bytes`` counts what is reserved,
    ``used_bytes`` what holds tokens: the gap is the waste chapter 02 removes.

    ``budget_bytes`` (the engine's ``kv_cache_memory_bytes``) caps what may be reserved at once, as a
    server with fixed memory must: a request is admitted only when its whole reservation fits, so
    the reservations of early-stopping requests cost concurrency. None: no cap (chapter 01)."""

    keeps_kv = True

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype, device, max_model_len: int,
                 budget_bytes: int | None = None):
        self.shape, self.num_layers = (num_kv_heads, head_dim), num_layers
        self.dtype, self.device, self.max_model_len = dtype, device, max_model_len
        self.budget_bytes = budget_bytes
        self.caches: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.lengths: dict[str, int] = {}

    def reserved_tokens(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Tokens reserved for a request: the longest it may become."""
        return min(num_prompt_tokens + max_tokens, self.max_model_len)

    def reservation_bytes(self, num_prompt_tokens: int, max_tokens: int) -> int:
        return self.reserved_tokens(num_prompt_tokens, max_tokens) * self._bytes_per_token()

    def can_allocate(self, req, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        if req.request_id in self.caches or self.budget_bytes is None:
            return True  # its whole length was reserved when it was admitted
        need = self.reservation_bytes(len(req.prompt_token_ids), req.params.max_tokens)
        return self.reserved_bytes + need <= self.budget_bytes

    def allocate(self, req, num_new_tokens):
        if req.request_id not in self.caches:
            capacity = self.reserved_tokens(len(req.prompt_token_ids), req.params.max_tokens)
            self.caches[req.request_id] = [
                tuple(torch.zeros(capacity, *self.shape, dtype=self.dtype, device=self.device) for _ in "kv")
                for _ in range(self.num_layers)]
        self.lengths[req.request_id] = req.num_computed_tokens + num_new_tokens

    def release(self, req):
        self.caches.pop(req.request_id, None)
        self.lengths.pop(req.request_id, None)

    def _bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.shape[0] * self.shape[1] * self.dtype.itemsize

    @property
    def reserved_bytes(self) -> int:
        return sum(layers[0][0].shape[0] for layers in self.caches.values()) * self._bytes_per_token()

    @property
    def used_bytes(self) -> int:
        return sum(self.lengths.values()) * self._bytes_per_token()

    def stats(self) -> dict:
        return {"kv_reserved_bytes": self.reserved_bytes, "kv_used_bytes": self.used_bytes}


class KVCacheManager(KVManager):
    """Paged KV: block tables over one pool, with an optional prefix cache and CPU tier.

    ``chain_hashes`` and ``longest_prefix`` (chapter 03's warm-ups) and ``free_blocks_needed``,
    ``hold_prefix_blocks`` and ``release_blocks`` (its hard exercise: admitting a prefix hit), and
    ``fork_blocks`` and ``copy_on_write`` (its exercise on sharing: parallel samples sharing a prompt) are
    attributes so the attendee's own can be plugged in (``LLMEngine.plugged``); ``allocator``
    likewise for chapter 02's. ``copy_block(src, dst)`` is the attention backend's: it copies a
    block's K/V in every layer.
    """

    keeps_kv = True
    PLUG_POINTS = {
        "block_allocator": PlugPoint("allocator", "an allocator of at most the pool's blocks (ch. 02)", kind="object",
                                     install="use_allocator"),
        "chain_hashes": PlugPoint("chain_hashes", "a request's full blocks -> their chained hashes (ch. 03)"),
        "longest_prefix": PlugPoint("longest_prefix", "the cached run at the start of a request (ch. 03)"),
        "free_blocks_needed": PlugPoint("free_blocks_needed", "what admitting a prefix hit costs (ch. 03)"),
        "hold_prefix_blocks": PlugPoint("hold_prefix_blocks", "share a hit's blocks, or reclaim them (ch. 03)"),
        "release_blocks": PlugPoint("release_blocks", "the order a request's blocks go back (ch. 03)"),
        "fork_blocks": PlugPoint("fork_blocks", "a sample starts on the parent's shared blocks (ch. 03)"),
        "copy_on_write": PlugPoint("copy_on_write", "a shared block, about to be written (ch. 03)"),
    }

    def __init__(self, num_blocks: int, block_size: int, allocator: BlockAllocator | None = None,
                 enable_prefix_caching: bool = False, cpu_tier: CPUTier | None = None):
        self.block_size = block_size
        self.pool_blocks = num_blocks  # the pool's blocks: a plugged allocator may hand out fewer, never more
        self.allocator = allocator or BlockAllocator(num_blocks)
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.cpu_tier = cpu_tier
        self.tables: dict[str, object] = {}  # request_id -> request holding blocks, for snapshots and checks
        self.counters = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "cpu_tier_hits": 0, "cow_copies": 0}
        self.chain_hashes = chain_hashes
        self.longest_prefix = longest_prefix
        self.free_blocks_needed = free_blocks_needed
        self.hold_prefix_blocks = hold_prefix_blocks
        self.release_blocks = release_blocks
        self.fork_blocks = fork_blocks
        self.copy_on_write = copy_on_write
        self.copy_block = None  # set by the engine: the backend's block copy
        self.events = None  # KV-cache events (serve --kv-events-config, serve/kv_events.py): blocks stored, removed

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def capacity(self) -> int:
        """A request alone can fill the pool, no more: past it nothing could free a block for it."""
        return self.num_blocks * self.block_size

    def can_allocate(self, req, num_new_tokens, hit=None):
        """Free blocks for the request's tokens after this step, less the live shared blocks a hit reuses."""
        hit = hit or PrefixHit(block_size=self.block_size)
        tokens = req.num_computed_tokens + hit.num_tokens + num_new_tokens
        more = blocks_needed(tokens, self.block_size) - len(req.kv.block_table)  # the hit's blocks included
        copies = len(self._shared_to_write(req))  # shared blocks this step writes into are copied first
        return self.free_blocks_needed(self.allocator.ref_counts, hit.device_blocks, more) + copies <= self.allocator.num_free

    def _shared_to_write(self, req) -> list[int]:
        """Indexes of the request's blocks that its next tokens are written into and that others hold too."""
        first = req.num_computed_tokens // self.block_size
        return [i for i in range(first, len(req.kv.block_table)) if self.allocator.ref_counts[req.kv.block_table[i]] > 1]

    def _new_block(self) -> int:
        block = self.allocator.allocate()
        if self.prefix_cache is not None:
            evicted = self.prefix_cache.evict(block)  # its old contents are about to be overwritten
            if evicted is not None and self.cpu_tier is not None:
                self.cpu_tier.save(*evicted, block)
            if evicted is not None and self.events is not None:  # after the copy: it moved, its chain still known
                self.events.removed([evicted[0]], "GPU")
        return block

    def allocate(self, req, num_new_tokens, offer: bool = True):
        for i in range(req.num_computed_tokens // self.block_size, len(req.kv.block_table)):
            before = req.kv.block_table[i]  # a block this step writes into: the sequence's own first (chapter 04)
            self.copy_on_write(self.allocator, req.kv.block_table, i, self._new_block, self.copy_block)
            self.counters["cow_copies"] += req.kv.block_table[i] != before
        missing = blocks_needed(req.num_computed_tokens + num_new_tokens, self.block_size) - len(req.kv.block_table)
        for _ in range(missing):
            req.kv.block_table.append(self._new_block())
        self.tables[req.request_id] = req
        # Offer the full blocks this step computes now, not after the step: a request admitted later in
        # the same step shares them (the step writes every new token's K/V before any attention reads).
        # Not for blocks another engine's KV will fill (chapter 07): they hold nothing yet.
        if offer:  # (not guesses of speculative decoding, past the request's tokens: they may be rejected)
            self.cache_full_blocks(req, min(req.num_computed_tokens + num_new_tokens, req.num_tokens))

    def trim(self, req):
        """Speculative decoding (chapter 09): blocks past the request's tokens held only rejected guesses'
        K/V; they go back to the pool (tail first), so a rejected guess costs no memory."""
        keep = blocks_needed(req.num_tokens, self.block_size)
        if len(req.kv.block_table) > keep:
            extra = req.kv.block_table[keep:]
            del req.kv.block_table[keep:]
            self.release_blocks(self.allocator, extra)

    def release(self, req):
        if self.prefix_cache is not None:  # blocks offered for a step that failed never got their KV
            for i in range(req.num_computed_tokens // self.block_size, len(req.kv.block_hashes)):
                evicted = self.prefix_cache.evict(req.kv.block_table[i])
                if evicted is not None and self.events is not None:
                    self.events.removed([evicted[0]], "GPU")
        self.release_blocks(self.allocator, req.kv.block_table)  # tail first: the shared prefix stays cached longest
        req.kv.block_table = []
        req.kv.block_hashes = []
        self.tables.pop(req.request_id, None)

    def fork(self, parent, child):
        """A sample of ``parent`` (``n > 1``) starts with its blocks, shared, and the hashes of the full
        blocks it will not write into (it recomputes the prompt's last token, as every sample must)."""
        child.kv.block_table = self.fork_blocks(self.allocator, parent.kv.block_table)
        child.kv.block_hashes = list(parent.kv.block_hashes[:child.num_computed_tokens // self.block_size])
        self.tables[child.request_id] = child

    def use_allocator(self, allocator):
        """Run the pool on another allocator (chapter 02's exercise); only while no request holds blocks."""
        if allocator.num_blocks > self.pool_blocks:
            raise ValueError(f"the allocator has {allocator.num_blocks} blocks; the pool holds {self.pool_blocks}")
        if self.tables:
            raise ValueError(f"{len(self.tables)} requests hold blocks: swap the allocator while the engine is idle")
        self.allocator = allocator
        self._forget_device_cache()  # cached entries named blocks of the old allocator

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, on the device and in the CPU tier (vLLM's ``LLM.reset_prefix_cache``), so
        the next request computes its whole prompt: a benchmark's repeat starts as cold as its first run. Only
        while no request holds blocks: False then, and nothing changes."""
        if self.tables:
            return False
        self._forget_device_cache()
        if self.cpu_tier is not None:
            self.cpu_tier.clear()
        return True

    def _forget_device_cache(self):
        if self.prefix_cache is not None:
            if self.events is not None and self.prefix_cache.block_of:
                self.events.removed(list(self.prefix_cache.block_of), "GPU")
            self.prefix_cache = PrefixCache()  # the blocks stay in the free list: only the index goes

    # ------------------------------------------------------------------ prefix caching

    def find_cached_prefix(self, req) -> PrefixHit:
        """The longest chain of cached full blocks at the start of the request (no state changes).
        At least one token is left to compute: its logits give the next token. A request asking for
        prompt logprobs reuses nothing: every prompt position needs its logits (vLLM does the same)."""
        hit = PrefixHit(block_size=self.block_size)
        if self.prefix_cache is None or req.params.prompt_logprobs is not None:
            return hit
        tokens, bs = req.all_token_ids, self.block_size
        hashes = self.chain_hashes(tokens[:(len(tokens) - 1) // bs * bs], bs, req.kv.cache_salt)

        def chunk(i):
            return tuple(tokens[i * bs:(i + 1) * bs])

        hit.device_blocks = self.longest_prefix(hashes, lambda i, h: self.prefix_cache.lookup(h, chunk(i)))
        done = len(hit.device_blocks)
        if self.cpu_tier is not None:  # the chain may go on in host memory
            rest = self.longest_prefix(hashes[done:], lambda i, h: h if self.cpu_tier.contains(h, chunk(done + i))
                                       else None)
            hit.cpu_hashes = list(rest)
        hit.hashes = hashes[:len(hit.device_blocks) + len(hit.cpu_hashes)]
        return hit

    def use_cached_prefix(self, req, hit):
        """Share live blocks, reclaim cached free ones, copy CPU-tier ones back. Returns tokens reused.

        Hit counters count a request's first admission only: a preempted request finding its own
        blocks again is recompute avoided, not a prefix shared (vLLM issue #25780)."""
        if self.prefix_cache is None:
            return 0
        self.hold_prefix_blocks(self.allocator, hit.device_blocks)  # share the live ones, reclaim the free ones
        req.kv.block_table.extend(hit.device_blocks)
        reused = len(hit.device_blocks)
        for h in hit.cpu_hashes:
            self.cpu_tier.touch(h)  # most recently used: our own evictions below must not push them out
        loaded = []
        for h in hit.cpu_hashes:
            block = self._new_block()
            if not self.cpu_tier.has(h):  # pushed out anyway (a tiny CPU tier): compute the rest
                self.allocator.free(block)
                break
            self.cpu_tier.load(h, block)
            bs = self.block_size
            if self.prefix_cache.insert(block, h, tuple(req.all_token_ids[reused * bs:(reused + 1) * bs])):
                loaded.append(reused)
            req.kv.block_table.append(block)
            reused += 1
        if loaded and self.events is not None:  # back on the device: routers may count them as device hits again
            self._stored(hit.hashes, req.all_token_ids, loaded)
        req.kv.block_hashes = list(hit.hashes[:reused])
        self.tables[req.request_id] = req
        if req.num_preemptions == 0:
            self.counters["prefix_cache_queries"] += req.num_tokens
            self.counters["prefix_cache_hits"] += reused * self.block_size
            self.counters["cpu_tier_hits"] += reused - len(hit.device_blocks)
            req.kv.num_host_cached_tokens = (reused - len(hit.device_blocks)) * self.block_size  # for /metrics' sources
        return reused * self.block_size

    def cache_full_blocks(self, req, num_tokens=None):
        if self.prefix_cache is None:
            return
        bs = self.block_size
        full = (req.num_computed_tokens if num_tokens is None else num_tokens) // bs
        if full <= len(req.kv.block_hashes):
            return
        tokens = req.all_token_ids[:full * bs]
        hashes = self.chain_hashes(tokens, bs, req.kv.cache_salt)
        new = [i for i in range(len(req.kv.block_hashes), full)
               if self.prefix_cache.insert(req.kv.block_table[i], hashes[i], tuple(tokens[i * bs:(i + 1) * bs]))]
        req.kv.block_hashes = hashes
        if new and self.events is not None:
            self._stored(hashes, tokens, new)

    def _stored(self, hashes: list, tokens: list[int], indexes: list[int]):
        """Report blocks ``indexes`` of a request (chained ``hashes``) as stored on the device, one event per
        run of consecutive blocks, each run's parent the block before it, as vLLM reports a request's blocks."""
        bs, start = self.block_size, 0
        for k in range(1, len(indexes) + 1):
            if k == len(indexes) or indexes[k] != indexes[k - 1] + 1:
                first, last = indexes[start], indexes[k - 1]
                self.events.stored(hashes[first:last + 1], list(tokens[first * bs:(last + 1) * bs]), "GPU",
                                   parent=hashes[first - 1] if first else None)
                start = k

    def stats(self) -> dict:
        stats = {"kv_blocks_total": self.num_blocks, "kv_blocks_free": self.allocator.num_free,
                 "block_size": self.block_size, "cpu_tier_blocks": len(self.cpu_tier) if self.cpu_tier else 0}
        return {**stats, **self.counters}  # the counters stay 0 without prefix caching

    def snapshot(self) -> dict:
        """The pool as the block-map widget draws it."""
        n, bs = self.num_blocks, self.block_size
        owners, tokens = [[] for _ in range(n)], [0] * n
        for rid, req in self.tables.items():
            for i, block in enumerate(req.kv.block_table):
                owners[block].append(rid)
                tokens[block] = max(tokens[block], min(bs, req.num_tokens - i * bs))
        cached = [bool(self.prefix_cache and self.prefix_cache.is_cached(b)) and not owners[b] for b in range(n)]
        return {"block_size": bs, "owners": owners, "ref_counts": list(self.allocator.ref_counts), "tokens": tokens,
                "cached": cached}
