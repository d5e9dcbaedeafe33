"""What the two engine hosts share (``serve/host_common.py``): the 429 rule, the metrics hook, and that neither host
imports the other."""
import ast
import logging
from pathlib import Path

import pytest

from labsupport.serve.host_common import call_hook, refuse_when_full, waiting_after
from labsupport.serve.request_stream import QueueFullError

SERVE = Path(__file__).resolve().parent.parent / "labsupport" / "serve"


def test_a_burst_that_fits_the_free_slots_waits_for_nobody():
    assert waiting_after(in_flight=3, new=5, max_num_seqs=8) == 0
    assert waiting_after(in_flight=3, new=6, max_num_seqs=8) == 1       # one past the slots
    assert waiting_after(in_flight=12, new=0, max_num_seqs=8) == 4


def test_requests_the_engine_reports_waiting_keep_new_ones_behind_them():
    # slots are free, but the core could not admit 2 (KV memory): a new request waits behind them
    assert waiting_after(in_flight=4, new=1, max_num_seqs=8, reported_waiting=2) == 3
    assert waiting_after(in_flight=4, new=1, max_num_seqs=8, reported_waiting=0) == 0
    assert waiting_after(in_flight=20, new=1, max_num_seqs=8, reported_waiting=2) == 13   # whichever is more


def test_refuse_when_full_is_the_429_rule():
    def waiting_with(new):                                                # 3 waiting now
        return 3 + new

    refuse_when_full(None, waiting_with, 10_000)                          # no limit
    refuse_when_full(4, waiting_with, 1)                                  # at the limit: accepted
    with pytest.raises(QueueFullError, match=r"3 requests are waiting \(max_waiting_requests=4\)"):
        refuse_when_full(4, waiting_with, 2)


def test_a_broken_metric_is_logged_and_never_stops_the_serving(caplog):
    class Broken:
        def on_step(self, *args):
            raise ZeroDivisionError("a bad gauge")

    seen = []

    class Good:
        def on_step(self, *args):
            seen.append(args)

    with caplog.at_level(logging.ERROR, logger="labsupport.serve.host_common"):
        call_hook(Broken(), "on_step", 1, 2)
    assert "metrics.on_step failed" in caplog.text
    call_hook(Good(), "on_step", 1, 2)
    call_hook(None, "on_step", 1, 2)                                      # a host without metrics
    assert seen == [(1, 2)]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {(node.module or "").lstrip(".") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}


def test_neither_host_imports_the_other():
    assert "async_engine" not in imported_modules(SERVE / "engine_core.py")
    assert "async_engine" not in imported_modules(SERVE / "core_client.py")
    assert not {"engine_core", "core_client"} & imported_modules(SERVE / "async_engine.py")
    for host in ("async_engine.py", "engine_core.py"):
        assert "def _hook" not in (SERVE / host).read_text()              # the hook lives in host_common, once
