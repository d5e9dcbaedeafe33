"""What an attendee may change on a live engine, and how it is put back: run-time options and plug points.

Chapters change a live engine in two ways. Options: ``max_num_seqs``, the token budget, chunked prefill
(``engine.options(...)``, checked as a whole before anything changes). Pieces: the attendee's
``schedule``, chunking rule, paged read, allocator, copy-on-write, ... put in place of the engine's own
at a named plug point (``engine.plugged(...)``). Both are ``with`` blocks that restore the engine on
exit, also when the attendee's code raised, so a chapter can go on (or be re-run) after a broken
exercise. The plug points are attributes of the scheduler, KV manager, backend, runner and connector:
the engine calls through them at every step, so a plugged piece runs inside the real engine, not a copy.
"""
from __future__ import annotations

import contextlib
import dataclasses

from .attention import ContiguousAttention
from .config import RUNTIME_OPTIONS
from .kv_cache_manager import KVCacheManager


class PlugPoints:
    """Mixed into ``LLMEngine``: reads its ``config``, ``scheduler``, ``kv``, ``backend``, ``runner``,
    ``speculator`` and ``connector``."""

    def set_options(self, **changes) -> dict:
        """Change scheduling options of a live engine (chapter 04's ``max_num_seqs`` dial); returns the
        old values. The whole new configuration is validated before anything changes."""
        unknown = set(changes) - set(RUNTIME_OPTIONS)
        if unknown:
            raise ValueError(f"{sorted(unknown)} cannot change while the engine lives; these can: {RUNTIME_OPTIONS}")
        dataclasses.replace(self.config, **changes)  # raises ValueError, saying what is wrong
        old = {name: getattr(self.config, name) for name in changes}
        for name, value in changes.items():
            setattr(self.config, name, value)
        return old

    @contextlib.contextmanager
    def options(self, **changes):
        """``with engine.options(max_num_seqs=4): ...`` -- every run-time option is as before on exit
        (all of them: one changed inside the block may only be valid together with another)."""
        before = {name: getattr(self.config, name) for name in RUNTIME_OPTIONS}
        self.set_options(**changes)
        try:
            yield self
        finally:
            self.config.__dict__.update(before)

    def _plug_points(self) -> dict:
        """Name -> (object, attribute) of every piece an exercise may replace, on this engine."""
        points = {"schedule_fn": (self.scheduler, "schedule_fn"),  # ch. 04: the whole scheduling policy
                  "chunk_rule": (self.scheduler, "chunk_rule"),  # ch. 05: tokens one request feeds
                  "admit_fn": (self.scheduler, "admit_fn")}  # ch. 05: the head of the queue joins, or waits
        if isinstance(self.backend, ContiguousAttention):
            points["attend_fn"] = (self.backend, "attend_fn")  # ch. 01: append to the cache and attend
        if isinstance(self.kv, KVCacheManager):
            points |= {"slot_mapping": (self.backend, "slot_mapping"),  # ch. 02: token -> pool slot
                       "decode_attention": (self.backend, "decode_attention"),  # ch. 02: the paged read
                       "mixed_attention": (self.backend, "mixed_attention"),  # ch. 02: a whole mixed step's read
                       "block_allocator": (self.kv, "allocator"),  # ch. 02: an allocator instance
                       "chain_hashes": (self.kv, "chain_hashes"),  # ch. 03: block hashes
                       "longest_prefix": (self.kv, "longest_prefix"),  # ch. 03: the cached run
                       "free_blocks_needed": (self.kv, "free_blocks_needed"),  # ch. 03: what admitting a hit costs
                       "hold_prefix_blocks": (self.kv, "hold_prefix_blocks"),  # ch. 03: share or reclaim
                       "release_blocks": (self.kv, "release_blocks"),  # ch. 03: the order blocks go back
                       "fork_blocks": (self.kv, "fork_blocks"),  # ch. 04: a sample starts on shared blocks
                       "copy_on_write": (self.kv, "copy_on_write")}  # ch. 04: a shared block, written
        if self.speculator is not None:
            points["rejection_sample"] = (self.runner, "rejection_sample")  # ch. 09: the acceptance rule
        if self.connector is not None:
            points |= {"pack_blocks": (self.connector.server, "pack_blocks"),  # ch. 07: blocks -> the wire
                       "unpack_blocks": (self.connector, "unpack_blocks")}  # ch. 07: the wire -> other blocks
        return points

    def plug(self, **pieces) -> dict:
        """Put the attendee's pieces into this engine; returns the pieces they replaced.

        Prefer ``plugged`` for an engine that is used afterwards: it puts the engine's own back."""
        points = self._plug_points()
        for name, piece in pieces.items():
            if name not in points:
                raise ValueError(f"no plug point {name!r} on this engine (kv_cache={self.config.kv_cache!r}); "
                                 f"it has {sorted(points)}")
            if name in ("schedule_fn", "mixed_attention") and piece is None:
                continue  # None: the engine's own policy, or its own split of decode and prefill rows
            if name != "block_allocator" and not callable(piece):
                raise ValueError(f"{name} must be a function, got {type(piece).__name__}")
        old = {name: getattr(*points[name]) for name in pieces}
        for name, piece in pieces.items():
            if name == "block_allocator":
                if piece.num_blocks > self.backend.num_blocks:
                    raise ValueError(f"the allocator has {piece.num_blocks} blocks; "
                                     f"the pool holds {self.backend.num_blocks}")
                self.kv.use_allocator(piece)  # raises unless the engine is idle
            else:
                setattr(*points[name], piece)
        return old

    @contextlib.contextmanager
    def plugged(self, **pieces):
        """``with engine.plugged(schedule_fn=my_schedule): ...`` runs the engine on the attendee's pieces
        and puts the engine's own back on exit, also when the attendee's code raised. Requests still
        in flight at exit ran on the plugged pieces; with a swapped allocator they are aborted."""
        old = self.plug(**pieces)
        try:
            yield self
        finally:
            if "block_allocator" in old and self.kv.tables:
                self.abort_requests(list(self.kv.tables.values()))
            self.plug(**old)
