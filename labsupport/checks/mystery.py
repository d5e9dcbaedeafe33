"""Chapter 03's planted-bug hunt: an engine with one bug drawn at random in how blocks are admitted, shared and
given back.

The mystery engine runs the real engine with the three block-keeping plug points of chapter 03's hard exercise
(``free_blocks_needed``, ``hold_prefix_blocks``, ``release_blocks``) replaced by copies written afresh: two of
them behave exactly like the engine's own, one carries a bug drawn from five that serving engines have really
had, all in what chapters 01-03 taught (a leak, a head-first free, a lost share, a fresh block taken for a cached
hit instead of that very block, an admission that counts a cached hit as free). None of the copies says which is
which: the attendee reads the evidence a dashboard gives (free blocks, prefix hits, tokens, errors, each beside
the engine's own; the block map), names the function and writes a fix.

The check judges the fix by what the engine does with it, never by the name: it installs the fix at the named
plug point and runs the workload again. A wrong name leaves the bug in place, and the check says which phase
still differs from the engine's own and how, as the evidence would. The draw is seeded (``planted_bug(llm,
seed)``), so a notebook run is reproducible, and ``bug.reference()`` is the drawn bug's own fix, for any seed.
The copies live in ``_mystery_pieces.py``, beside the correct ones, so that reading this file does not point at
the answer.
"""
from __future__ import annotations

import base64
import contextlib
import inspect
import json
import random
import weakref
import zlib
from dataclasses import dataclass, field

from . import _mystery_pieces as pieces
from .base import CheckFailed, passed

FUNCTIONS = ("free_blocks_needed", "hold_prefix_blocks", "release_blocks")

# Which copy is correct and which carries which bug, sealed (zlib, then base64) so that a listing of this module
# does not give the hunt away: kind -> [the function it sits in, its buggy copy in _mystery_pieces, what was
# wrong], and the correct copy of each function. ``reveal(bug)`` opens it, for the check and for the tests.
_SEALED = (
    "eNqFVMtu4zAM/BXCl70ERR+3ALs/sigM2aYrIqqUleikQZF/L0nZQeIG20tgkeJwZkjls+mmt9Js4bMZMxbfdiH1Ozn/bXwKQ7vPONJH"
    "jZZmAzX6cvm6yQOntAMHhgQWgzSOwB41hhCoMIwpy53e9R4H8MRAsTC6Qa5Cxj44eqf4JkWO4YD5VIG2hqLXK25hd5J6gz16Cmj5jP8m"
    "lB5TkRzxBlwclvZCKUW57Ap4DAN0J4gJ2HUBN1DSdf2vIl8BXam8B+FbuxopRXAhC+WTpZtXdUOO7Ui5sJk3l18Zt0Serw+zb7WJQoBB"
    "VLHFuyzhajEcMYp2pyTS2lGtMQ1U2eGBesYZzOhJu90PxF7uECuc9nsB6lCmhjKpAT/gsdIz8MuUpafOahmAsogaqtoqh1S4NVE/7dfT"
    "//cr0KGuwpHYp4nNKd0ZEueIdXgj9GkSw96pFJufomG+DLqSX9iKoyL78H3aCEl+svhAIdhWmZIkwlo3KDilaGq0cqbZRgGRm3KxV8mm"
    "5nu+MqzkLmu9LOfRY1xJUUv//IbHDdADPsgGHt2pbG+fUuWZ4mpBlIYsO3sxySxwN4NSJaxMbL3XpZPQkVpzsHk9m6osD5WXf4217u2s"
    "+/n+FDVv0TsvQXNL5Kk5n78AYgmfoQ=="
)


def _unseal() -> dict:
    return json.loads(zlib.decompress(base64.b64decode("".join(_SEALED))))


def _piece(name: str):
    return getattr(pieces, name)


BUG_KINDS = ("fresh_block", "head_first", "leak", "lost_share", "over_admission")  # sorted: the draw's order


def correct_pieces() -> dict:
    """plug point -> the copy of it that behaves exactly like the engine's own."""
    return {fn: _piece(name) for fn, name in _unseal()["correct"].items()}


def planted_pieces(kind: str) -> dict:
    """plug point -> the function the mystery engine runs with bug ``kind`` (one of ``BUG_KINDS``) planted."""
    function, buggy, _ = _unseal()["bugs"][kind]
    return {**correct_pieces(), function: _piece(buggy)}


POOL_BLOCKS = 20  # the workload's fresh pool: small, so that eviction and a tight admission happen


@dataclass
class Phase:
    """What one phase of the workload left behind: the evidence of a dashboard."""

    name: str
    tokens: list = field(default_factory=list)
    hits: int = 0
    free_after: int = 0
    error: str | None = None
    snapshot: dict = field(default_factory=dict)  # the block map after the phase (KVCacheManager.snapshot)


def plan(block_size: int) -> list[tuple[str, list[list[int]]]]:
    """The workload's five phases, (name, prompts): two requests sharing a prefix at once (live sharing), a third
    after them (a cached hit), a filler that evicts cached blocks, the prefix again (what survived), and a tight
    pool: a long request holding 16 of the 20 blocks with the prefix behind it, which fits only once it is gone."""
    bs = block_size
    prefix = list(range(2000, 2000 + 4 * bs))
    ask = [prefix + list(range(3000 + 10 * i, 3000 + 10 * i + bs // 2)) for i in range(5)]
    return [("two at once", [ask[0], ask[1]]), ("one after", [ask[2]]),
            ("filler", [list(range(5000, 5000 + 16 * bs + bs // 2))]), ("prefix again", [ask[3]]),
            ("tight pool", [list(range(7000, 7000 + 16 * bs - bs // 2)), ask[4]])]


def workload(llm, max_steps: int = 400, **plugged) -> list[Phase]:
    """The phases of ``plan`` on a fresh ``POOL_BLOCKS``-block pool of ``llm`` (a prefix-caching paged engine),
    greedy, half a block of tokens each. ``plugged``: the plug points to run it on. A phase that raises or stalls
    is recorded (evidence too), its requests aborted, and the workload stops there."""
    from ..engine.block_pool import BlockAllocator
    from ..engine.request import SamplingParams

    bs = llm.engine.kv.block_size
    params = SamplingParams(max_tokens=bs // 2, temperature=0, ignore_eos=True)
    engine, phases = llm.engine, []
    with llm.plugged(block_allocator=BlockAllocator(POOL_BLOCKS), **plugged):
        for name, prompts in plan(bs):
            phase, before = Phase(name), llm.stats()
            reqs = []
            try:
                reqs = [engine.add_request(p, params) for p in prompts]
                for _ in range(max_steps):
                    if not engine.has_unfinished_requests():
                        break
                    engine.step()
                else:
                    phase.error = f"stalled: requests still waiting after {max_steps} steps"
            except Exception as exc:  # noqa: BLE001 - the planted bug may raise inside the engine: evidence
                phase.error = f"{type(exc).__name__}: {exc}"
            if phase.error:
                with contextlib.suppress(Exception):
                    engine.abort_requests([r for r in reqs if not r.is_finished])
            phase.tokens = [r.output_token_ids for r in reqs]
            after = llm.stats()
            phase.hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
            phase.free_after = after["kv_blocks_free"]
            phase.snapshot = engine.kv.snapshot()
            phases.append(phase)
            if phase.error:
                break
        engine.kv.tables.clear()  # what a failed phase still held: the engine's own allocator comes back
    return phases


_OWN_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def own_run(llm) -> list[Phase]:
    """The workload on ``llm``'s own pieces: run once per engine, then kept (greedy on a fresh pool, it gives the
    same phases every time), so a check tried again runs only the attendee's fix."""
    if llm not in _OWN_RUNS:
        _OWN_RUNS[llm] = workload(llm)
    return _OWN_RUNS[llm]


class PlantedBug:
    """The mystery engine: ``run()`` it, read ``source(name)`` of each function it runs, fix one. (What was
    drawn is not kept: neither this object's attributes nor the module's source name it; ``reference()`` and
    ``reveal()`` work it out from the seed when asked.)"""

    def __init__(self, llm, seed: int):
        self.llm, self.seed = llm, seed
        self.pieces = planted_pieces(_kind(seed))  # plug point -> the function the mystery engine runs

    def run(self) -> list[Phase]:
        return workload(self.llm, **self.pieces)

    def own(self) -> list[Phase]:
        """The same workload on the engine's own pieces, beside which the run is read."""
        return own_run(self.llm)

    def source(self, name: str) -> str:
        """The code the mystery engine runs at plug point ``name``, under that name."""
        fn = self.pieces[name]
        return inspect.getsource(fn).replace(f"def {fn.__name__}(", f"def {name}(", 1)

    def reference(self):
        """(the plug point that carries the drawn bug, a correct version of it: the engine's own), for any seed:
        what ``USE_REFERENCE`` swaps in."""
        from ..engine import block_pool

        function = reveal(self)[1]
        return function, getattr(block_pool, function)

    def reveal(self) -> str:
        """What was planted and its fix: for after the check (the notebook's reveal answers its default seed)."""
        _, function, diagnosis = reveal(self)
        return f"seed {self.seed}: {diagnosis}.\nThe fix, the engine's own:\n\n{inspect.getsource(self.reference()[1])}"


def _kind(seed: int) -> str:
    return random.Random(seed).choice(BUG_KINDS)


def reveal(bug: PlantedBug) -> tuple[str, str, str]:
    """(kind, function, diagnosis) of the bug drawn: for the check's verdict, ``PlantedBug.reveal`` and the tests."""
    kind = _kind(bug.seed)
    function, _, diagnosis = _unseal()["bugs"][kind]
    return kind, function, diagnosis


def planted_bug(llm, seed: int = 0) -> PlantedBug:
    """An engine with one planted bug, drawn with ``seed`` from ``BUG_KINDS``; ``llm``: a prefix-caching paged engine."""
    if llm.engine.kv.prefix_cache is None:
        raise ValueError("the planted-bug engine needs enable_prefix_caching=True")
    return PlantedBug(llm, seed)


def _tokens_same(p: Phase, o: Phase) -> str:
    return "same" if p.tokens == o.tokens else "DIFFERENT"


def evidence(phases: list[Phase], own: list[Phase]) -> str:
    """The dashboard of a run beside the engine's own, one line a phase: each number as ``run (own)``."""
    lines = [f"{'phase':14s}{'free blocks after':>20s}{'prefix tokens reused':>23s}  {'tokens':10s} error",
             f"{'':14s}{'run (own)':>20s}{'run (own)':>23s}  {'vs own':10s}"]
    for p, o in zip(phases, own):
        free = f"{p.free_after}/{POOL_BLOCKS} ({o.free_after})"
        hits = f"{p.hits} ({o.hits})"
        lines.append(f"{p.name:14s}{free:>20s}{hits:>23s}  {_tokens_same(p, o):10s} {p.error or '-'}")
    if len(phases) < len(own):
        lines.append(f"(the run stopped there: {len(own) - len(phases)} phases not run)")
    return "\n".join(lines)


def first_difference(phases: list[Phase], own: list[Phase]) -> str | None:
    """How the first phase that differs from the engine's own differs, in the evidence's words; None if none."""
    for p, o in zip(phases, own):
        if p.error:
            return f"phase '{p.name}' failed: {p.error}"
        if p.free_after != o.free_after:
            return (f"after phase '{p.name}', {p.free_after} of {POOL_BLOCKS} blocks were free (the engine's own: "
                    f"{o.free_after})")
        if p.hits != o.hits:
            return f"phase '{p.name}' reused {p.hits} prefix tokens (the engine's own: {o.hits})"
        if p.tokens != o.tokens:
            return f"phase '{p.name}' generated other tokens than the engine's own"
    if len(phases) != len(own):
        return f"the workload stopped after phase '{phases[-1].name}'"
    return None


def check_bug_fix(bug: PlantedBug, function_name, fixed) -> None:
    """``function_name``: which of ``FUNCTIONS`` carries the bug; ``fixed``: a correct version of it. The fix is
    installed at that plug point of the mystery engine and the workload runs again: every phase must free every
    block and give the engine's own tokens and prefix hits. Judged by what the engine does, not by the name: if
    the bug is still there, the verdict says where it still shows, and nothing about the name."""
    if function_name is None or fixed is None:
        raise CheckFailed(f"set BUGGY_FUNCTION to the name of the plug point whose copy carries the bug (one of "
                          f"{', '.join(FUNCTIONS)}) and fixed_piece to a correct version of it, with the same "
                          "arguments")
    name = str(function_name).strip()
    if name not in FUNCTIONS:
        raise CheckFailed(f"BUGGY_FUNCTION is {name!r}: name one of {', '.join(FUNCTIONS)}")
    if not callable(fixed):
        raise CheckFailed(f"fixed_piece is a {type(fixed).__name__}: it must be a function with the arguments of "
                          f"{name}")
    own = bug.own()
    yours = workload(bug.llm, **{**bug.pieces, name: fixed})
    difference = first_difference(yours, own)
    if difference:
        raise CheckFailed(f"with your {name} in the mystery engine, {difference}. The bug is still there: read the "
                          "evidence again (which phase went wrong first, in which column) before the code.")
    passed(f"with your {name} the engine freed every block after each of {len(own)} phases and gave its own tokens "
           f"and prefix hits. What was planted: {reveal(bug)[2]}")
