"""Chapter 03's planted-bug hunt: an engine with one bug drawn at random in how blocks are shared and given back.

The mystery engine runs the real engine with its three block-keeping plug points (``hold_prefix_blocks``,
``release_blocks``, ``copy_on_write``) replaced by copies written afresh: two of them behave exactly like the
engine's own, one carries a bug drawn from four that serving engines have really had (a leak, a lost share, a
head-first free, a skipped copy-on-write). None of the copies says which is which: the attendee reads the
evidence a dashboard gives (free blocks, the block map, hits, tokens against the engine's own, copy-on-write
counts, errors), names the function and writes a fix, and the check runs the fix in the real engine.

The draw is seeded (``planted_bug(llm, seed)``), so a notebook run is reproducible. The copies live in
``_mystery_pieces.py``, beside the correct ones, so that reading this file does not point at the answer.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import inspect
import json
import random
import zlib
from dataclasses import dataclass, field

from . import _mystery_pieces as pieces
from .base import CheckFailed, passed

FUNCTIONS = ("hold_prefix_blocks", "release_blocks", "copy_on_write")

# Which copy is correct and which carries which bug, sealed (zlib, then base64) so that a listing of this module
# does not give the hunt away: kind -> [the function it sits in, its buggy copy in _mystery_pieces, what the
# check says once it is found], and the correct copy of each function. ``reveal(bug)`` opens it, for the cell
# after the check and for the tests.
_SEALED = (
    "eNqFksFOwzAQRH9llAuXHqDcIvgC7lxQFbnOhlhxs8HrNK1Q/5213RYqgTgkstfr8ZuxP6vt/C5Vjc+qJ9M2nQsSdfpWBfJkhJqt"
    "ZztItcK1sv45KcvoAlGLJIEsUSP2BOlN0PIUqHMHLDRGbI0dSssKwnARixHQ3tlI573VRvVVffiH4/EXDok8TSq0pY4DwY0tHXBf"
    "aLI4ciO40zMpHBHoYyYpFGMqFSuFgSU22UMm6dm3TfHygyZXH66jm3VE5gEG3u0JffLqYs9zzMG48V3t1/qJUnSwPGs+Oyei/AZJ"
    "jUIO6Rv+QhsZaltFS+7m7Co1sv6C5uC8xyxnJzK4FEtjeclWLE/HhsdmCS5SYs+DcrM3a0q1m/IlJnQ8PWNdfx+3MMTsJk+iV+/b"
    "HGLaFmnU6DF5Y2kFMrY/94E14dSRzF9p7wQvr9XmlA8PgWzMD/IWsr5A/pF1asjVX55nWrtUHqrT6Qtr/wnJ"
)


def _unseal() -> dict:
    return json.loads(zlib.decompress(base64.b64decode("".join(_SEALED))))


def _piece(name: str):
    return getattr(pieces, name)


BUG_KINDS = ("head_first", "leak", "lost_share", "skipped_cow")  # the four bugs' names, sorted: the draw's order


def correct_pieces() -> dict:
    """plug point -> the copy of it that behaves exactly like the engine's own."""
    return {fn: _piece(name) for fn, name in _unseal()["correct"].items()}


def planted_pieces(kind: str) -> dict:
    """plug point -> the function the mystery engine runs with bug ``kind`` (one of ``BUG_KINDS``) planted."""
    function, buggy, _ = _unseal()["bugs"][kind]
    return {**correct_pieces(), function: _piece(buggy)}


def _answer_digest(seed: int, function: str) -> str:
    return hashlib.sha256(f"{seed}:{function}".encode()).hexdigest()


@dataclass
class Phase:
    """What one phase of the workload left behind: the evidence of a dashboard."""

    name: str
    tokens: list = field(default_factory=list)
    hits: int = 0
    free_after: int = 0
    cow_copies: int = 0
    error: str | None = None
    snapshot: dict = field(default_factory=dict)  # the block map after the phase (KVCacheManager.snapshot)


def workload(llm, max_steps: int = 400, **plugged) -> list[Phase]:
    """Five phases on a fresh 20-block pool of ``llm`` (a prefix-caching paged engine): two requests sharing a
    prefix at once, a third after them, a filler that evicts cached blocks, the prefix again, and one prompt
    sampled twice (``n = 2``, seeded). ``plugged``: the plug points to run it on. A phase that raises or stalls
    is recorded (evidence too), its requests aborted, and the workload stops there."""
    from ..engine.block_pool import BlockAllocator
    from ..engine.request import SamplingParams

    bs = llm.engine.kv.block_size
    prefix = list(range(2000, 2000 + 4 * bs))
    ask = [prefix + list(range(3000 + 10 * i, 3000 + 10 * i + bs // 2)) for i in range(4)]
    greedy = SamplingParams(max_tokens=bs // 2, temperature=0, ignore_eos=True)
    plan = [("two at once", [ask[0], ask[1]], greedy), ("one after", [ask[2]], greedy),
            ("filler", [list(range(5000, 5000 + 16 * bs + bs // 2))], greedy), ("prefix again", [ask[3]], greedy),
            ("two samples", [list(range(7000, 7000 + bs + bs // 4))],
             SamplingParams(max_tokens=bs // 2, temperature=1.0, seed=3, n=2, ignore_eos=True))]
    engine, phases = llm.engine, []
    with llm.plugged(block_allocator=BlockAllocator(20), **plugged):
        for name, prompts, params in plan:
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
            phase.tokens = [[s.output_token_ids for s in (r, *r.samples)] for r in reqs]
            after = llm.stats()
            phase.hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
            phase.free_after = after["kv_blocks_free"]
            phase.cow_copies = after["cow_copies"] - before["cow_copies"]
            phase.snapshot = engine.kv.snapshot()
            phases.append(phase)
            if phase.error:
                break
        engine.kv.tables.clear()  # what a failed phase still held: the engine's own allocator comes back
    return phases


class PlantedBug:
    """The mystery engine: ``run()`` it, read ``source(name)`` of each function it runs, fix one. (What was
    drawn is kept only as a digest of the answer: neither this object nor the module's source names it.)"""

    def __init__(self, llm, seed: int):
        self.llm, self.seed = llm, seed
        kind = random.Random(seed).choice(BUG_KINDS)
        self._answer = _answer_digest(seed, _unseal()["bugs"][kind][0])
        self.pieces = planted_pieces(kind)  # plug point -> the function the mystery engine runs

    def run(self) -> list[Phase]:
        return workload(self.llm, **self.pieces)

    def source(self, name: str) -> str:
        """The code the mystery engine runs at plug point ``name``, under that name."""
        fn = self.pieces[name]
        return inspect.getsource(fn).replace(f"def {fn.__name__}(", f"def {name}(", 1)


def reveal(bug: PlantedBug) -> tuple[str, str, str]:
    """(kind, function, diagnosis) of the bug drawn: for the cell after the check, and for the tests."""
    kind = random.Random(bug.seed).choice(BUG_KINDS)
    function, _, diagnosis = _unseal()["bugs"][kind]
    return kind, function, diagnosis


def planted_bug(llm, seed: int = 0) -> PlantedBug:
    """An engine with one planted bug, drawn with ``seed`` from ``BUG_KINDS``; ``llm``: a prefix-caching paged engine."""
    if llm.engine.kv.prefix_cache is None:
        raise ValueError("the planted-bug engine needs enable_prefix_caching=True")
    return PlantedBug(llm, seed)


def evidence(phases: list[Phase], own: list[Phase]) -> str:
    """The dashboard of a run beside the engine's own, one line a phase."""
    lines = [f"{'phase':14s}{'free after':>11s}{'hits':>6s}{'CoW copies':>11s}  tokens     error"]
    for p, o in zip(phases, own):
        same = "same" if p.tokens == o.tokens else "DIFFERENT"
        lines.append(f"{p.name:14s}{p.free_after:>8d}/20{p.hits:>6d}{p.cow_copies:>11d}  {same:10s} {p.error or '-'}")
    return "\n".join(lines)


def check_bug_fix(bug: PlantedBug, function_name: str, fixed) -> None:
    """``function_name``: which of ``FUNCTIONS`` carries the bug; ``fixed``: a correct version of it. The mystery
    engine runs the workload again with the fix in place of its copy: it must give the engine's own tokens, hits
    and copy-on-write copies, and free every block after every phase."""
    name = str(function_name).strip()
    if name not in FUNCTIONS:
        raise CheckFailed(f"name one of {FUNCTIONS}")
    if _answer_digest(bug.seed, name) != bug._answer:
        raise CheckFailed(f"{name} is not where the bug is: the copy of it in bug.pieces behaves like the engine's "
                          "own. Which phase went wrong first, and which function ran in it?")
    own = workload(bug.llm)
    try:
        yours = workload(bug.llm, **{**bug.pieces, name: fixed})
    except Exception as exc:  # noqa: BLE001 - the attendee's code
        raise CheckFailed(f"the engine failed on your fix: {type(exc).__name__}: {exc}") from exc
    for p, o in zip(yours, own):
        if p.error:
            raise CheckFailed(f"with your {name}, phase '{p.name}' failed: {p.error}")
        if p.free_after != 20:
            raise CheckFailed(f"with your {name}, {20 - p.free_after} blocks were still held after phase '{p.name}'")
        if p.tokens != o.tokens:
            raise CheckFailed(f"with your {name}, phase '{p.name}' generated other tokens than the engine's own")
        if (p.hits, p.cow_copies) != (o.hits, o.cow_copies):
            raise CheckFailed(f"with your {name}, phase '{p.name}' reused {p.hits} prefix tokens and copied "
                              f"{p.cow_copies} blocks on write; the engine's own: {o.hits} and {o.cow_copies}")
    if len(yours) != len(own):
        raise CheckFailed(f"with your {name} the workload stopped after phase '{yours[-1].name}'")
    passed(f"{name} is where the bug was ({reveal(bug)[2]}); with your fix the engine freed every block after "
           f"each of {len(own)} phases and gave its own tokens, hits and copies")
