"""What an attendee may change on a live engine, and how it is put back: run-time options and plug points.

Chapters change a live engine in two ways. Options: ``max_num_seqs``, the token budget, chunked prefill
(``engine.options(...)``, checked as a whole by ``EngineConfig`` itself before anything changes). Pieces: the
attendee's ``schedule``, chunking rule, paged read, allocator, copy-on-write, ... put in place of the engine's
own at a named plug point (``engine.plugged(...)``). Both are ``with`` blocks that restore the engine on exit,
also when the attendee's code raised, so a chapter can go on (or be re-run) after a broken exercise.

Each component declares its own plug points in a class attribute ``PLUG_POINTS`` (name -> ``PlugPoint``: the
attribute the component calls through at every step, and what a piece there must be), so a reader finds a plug
point beside the code that calls it. ``PlugRegistry`` gathers the points of the components an engine (or the
serving loop) is built from; its ``plugged`` is the one ``with`` block every chapter's check goes through. The
engine calls through those attributes at every step, so a plugged piece runs inside the real engine, not a copy.
This module imports no component: they import it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

from .config import RUNTIME_OPTIONS

KINDS = ("function", "function or None", "object")


@dataclasses.dataclass(frozen=True)
class PlugPoint:
    """One place a piece goes. ``attribute``: the declaring component's attribute that holds it (a dotted path
    reaches a part the component owns, e.g. the connector's KV server). ``expects``: what the engine calls it
    with, said in the error an attendee sees. ``kind``: a function; a function or None (None: the engine's own
    rule); or any object. ``install``: a method of the owner that takes the piece instead of a plain assignment,
    for a piece the owner must check against its state (an allocator swapped only while no request holds blocks)."""

    attribute: str
    expects: str
    kind: str = "function"
    install: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"a plug point's kind is one of {KINDS}, got {self.kind!r}")


class PlugRegistry:
    """The plug points of some components, by name: read, checked, swapped and restored in one place."""

    def __init__(self, *components, describe: str = "this engine"):
        self.describe = describe  # named in the error for a plug point that does not exist here
        self.slots: dict[str, tuple[object, PlugPoint]] = {}
        for component in components:
            if component is None:
                continue  # a part this engine was built without (no connector, no speculator)
            for name, point in type(component).PLUG_POINTS.items():
                if name in self.slots:
                    raise ValueError(f"plug point {name!r} is declared by both {type(self.slots[name][0]).__name__} "
                                     f"and {type(component).__name__}")
                self.slots[name] = (component, point)

    def names(self) -> list[str]:
        return sorted(self.slots)

    def __contains__(self, name: str) -> bool:
        return name in self.slots

    def _owner(self, name: str) -> tuple[object, str]:
        component, point = self.slots[name]
        *path, attribute = point.attribute.split(".")
        for part in path:
            component = getattr(component, part)
        return component, attribute

    def get(self, name: str):
        """The piece at ``name`` now."""
        return getattr(*self._owner(name))

    def check(self, pieces: dict):
        """Raise ValueError, before anything changes, for a name this registry lacks or a piece of the wrong kind."""
        for name, piece in pieces.items():
            if name not in self.slots:
                raise ValueError(f"no plug point {name!r} on {self.describe}; it has {self.names()}")
            point = self.slots[name][1]
            if point.kind == "object" or (piece is None and point.kind == "function or None"):
                continue
            if not callable(piece):
                raise ValueError(f"{name} must be a function ({point.expects}), got {type(piece).__name__}")

    def swap(self, pieces: dict) -> dict:
        """Put ``pieces`` in; returns the pieces they replaced. All or nothing: if one cannot go in (its owner
        refused it), those already in are taken out again before the error propagates."""
        self.check(pieces)
        old = {name: self.get(name) for name in pieces}
        done = []
        try:
            for name, piece in pieces.items():
                self._install(name, piece)
                done.append(name)
        except BaseException:
            for name in reversed(done):
                self._install(name, old[name])
            raise
        return old

    def _install(self, name: str, piece):
        owner, attribute = self._owner(name)
        point = self.slots[name][1]
        if point.install is not None:
            getattr(owner, point.install)(piece)
        else:
            setattr(owner, attribute, piece)

    @contextlib.contextmanager
    def plugged(self, pieces: dict, before_restore: Callable[[set[str]], None] | None = None):
        """``with registry.plugged({"schedule_fn": mine}): ...`` runs on the pieces and puts the old ones back on
        exit, also when the code inside raised. ``before_restore(names)`` runs first, for an owner that takes a
        piece back only in some state (the engine aborts the requests holding a plugged allocator's blocks)."""
        old = self.swap(pieces)
        try:
            yield self
        finally:
            if before_restore is not None:
                before_restore(set(old))
            self.swap(old)


class RuntimeOptions:
    """The options of ``config.RUNTIME_OPTIONS`` on a live engine's one ``EngineConfig``: every change, and every
    restore, is validated by ``EngineConfig`` itself (``dataclasses.replace`` runs its checks) before the shared
    object changes, so the scheduler and the prompt check, which read that object, never see a half-made one."""

    def __init__(self, config):
        self.config = config
        self.watchers: list[Callable] = []  # called with the config after every change and restore

    def watch(self, fn: Callable):
        """Call ``fn(config)`` after every change (and restore) of an option: a part sized by an option when the
        engine was built follows it (CUDA graphs recorded for every batch up to ``max_num_seqs``)."""
        self.watchers.append(fn)

    def set(self, **changes) -> dict:
        """Change options now (chapter 04's ``max_num_seqs`` dial); returns the old values."""
        unknown = set(changes) - set(RUNTIME_OPTIONS)
        if unknown:
            raise ValueError(f"{sorted(unknown)} cannot change while the engine lives; these can: {RUNTIME_OPTIONS}")
        old = {name: getattr(self.config, name) for name in changes}
        self._apply(changes)
        return old

    def _apply(self, values: dict):
        checked = dataclasses.replace(self.config, **values)  # raises ValueError, saying what is wrong
        for name in values:
            setattr(self.config, name, getattr(checked, name))
        for fn in self.watchers:
            fn(self.config)

    @contextlib.contextmanager
    def changed(self, **changes):
        """Every run-time option is as before on exit (all of them: one changed inside the block may only be
        valid together with another)."""
        before = {name: getattr(self.config, name) for name in RUNTIME_OPTIONS}
        self.set(**changes)
        try:
            yield self
        finally:
            self._apply(before)
