"""The decision ledger: verdicts made by ``labsupport.measure`` from planted samples, recorded as decisions."""
import json
import os
import warnings

import pytest

from labsupport import ledger
from labsupport.measure import noise_band, verdict

FAST = {"n_resamples": 500}   # the interval's ends barely matter here: the planted gaps are wide
BASE = [100.0 + (i * 7) % 5 for i in range(24)]         # one configuration, a little noise
AGAIN = [100.0 + (i * 3) % 5 for i in range(24)]        # the same configuration run again
BAND = noise_band(BASE, AGAIN, **FAST)


def latency_verdict(factor, higher_is_better=False):
    """The technique's latencies at ``factor`` times the control's, judged against the control's A/A band."""
    return verdict(BASE, [factor * x for x in BASE], BAND, higher="slower", lower="faster",
                   higher_is_better=higher_is_better, **FAST)


def test_a_verdict_the_better_way_beyond_the_band_is_keep(tmp_path):
    v = latency_verdict(0.5)
    assert v.better is True
    entry = ledger.record("04", "continuous batching", "static batching", v, f"TTFT P50 {v}", path=tmp_path / "l.json")
    assert entry.decision == "Keep"


def test_a_verdict_the_worse_way_beyond_the_band_is_reject(tmp_path):
    v = latency_verdict(2.0)
    assert v.better is False
    assert ledger.record("05", "chunked", "whole", v, f"ITL {v}", path=tmp_path / "l.json").decision == "Reject"


def test_a_level_verdict_is_inconclusive(tmp_path):
    v = latency_verdict(1.0)
    assert v.sign == 0 and v.better is None
    assert ledger.record("06", "async", "lock", v, f"TTFT {v}", path=tmp_path / "l.json").decision == "Inconclusive"


def test_a_verdict_made_without_a_direction_needs_one_from_the_caller(tmp_path):
    v = latency_verdict(0.5, higher_is_better=None)
    with pytest.raises(ValueError, match="higher_is_better"):
        ledger.decide(v)
    assert ledger.decide(v, higher_is_better=False) == "Keep"
    assert ledger.decide(v, higher_is_better=True) == "Reject"
    assert ledger.decide(latency_verdict(1.0, higher_is_better=None)) == "Inconclusive"   # level needs no direction
    with pytest.raises(ValueError, match="made with higher_is_better=False"):
        ledger.decide(latency_verdict(0.5), higher_is_better=True)
    with pytest.raises(ValueError, match="not better="):
        ledger.decide(v, better=True)


def test_a_word_is_decided_only_by_an_explicit_better(tmp_path):
    assert ledger.decide("1P+1D ahead", better=True) == "Keep"
    assert ledger.decide("colocated ahead", better=False) == "Reject"
    assert ledger.decide("one run each", better=None) == "Inconclusive"
    assert ledger.decide(None) == "Inconclusive"   # no verdict could be made (no band): nothing to decide by
    with pytest.raises(ValueError, match="no verdict"):
        ledger.decide(None, better=True)
    with pytest.raises(ValueError, match="better=True"):
        ledger.record("07", "1P+1D", "colocated", "ahead", "8 of 8 against 5 of 8", path=tmp_path / "l.json")
    with pytest.raises(ValueError, match="True, False or None"):
        ledger.decide("higher", better=1)
    with pytest.raises(ValueError, match="neither won"):
        ledger.decide("level", better=True)
    with pytest.raises(ValueError, match="Verdict or a word"):
        ledger.decide(1.5, better=True)
    with pytest.raises(ValueError, match="evidence"):
        ledger.record("07", "1P+1D", "colocated", "level", "  ", better=None, path=tmp_path / "l.json")
    assert not (tmp_path / "l.json").exists()   # nothing recorded from bad input


def test_recording_a_technique_again_replaces_its_entry(tmp_path):
    path = tmp_path / "l.json"
    ledger.record("04", "continuous batching", "static batching", "one run each", "first run", better=None, path=path)
    ledger.record(3, "prefix caching", "no cache", "level", "counts", better=None, path=path)
    ledger.record("04", "continuous batching", "static batching", latency_verdict(0.5), "second run", path=path)
    got = ledger.entries(path)
    assert [(e.chapter, e.decision, e.evidence) for e in got] == [("03", "Inconclusive", "counts"),
                                                                  ("04", "Keep", "second run")]
    saved = json.loads(path.read_text())
    assert [e["evidence"] for e in saved["entries"]] == ["counts", "second run"]
    # a parameter in the technique's name changed (chapter 09's k): still one row for the chapter, the latest
    ledger.record("09", "speculative decoding (k = 4)", "plain decoding", "level", "first", better=None, path=path)
    ledger.record("09", "speculative decoding (k = 2)", "plain decoding", "level", "then", better=None, path=path)
    assert [(e.chapter, e.technique) for e in ledger.entries(path)][-1:] == [("09", "speculative decoding (k = 2)")]
    assert len([e for e in ledger.entries(path) if e.chapter == "09"]) == 1


def test_the_file_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "l.json"
    ledger.record("01", "KV cache", "recompute", "one run each", "4.9x, one run each", better=None, path=path)
    before = path.read_text()

    def crash(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.warns(RuntimeWarning, match="could not be written"):
        ledger.record("02", "paged", "contiguous", "one run each", "2.0x", better=None, path=path)
    assert path.read_text() == before                               # the old ledger, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.json"]   # no temporary file left behind
    assert [e.chapter for e in ledger.entries(path)] == ["01", "02"]  # the new entry kept in memory meanwhile


def test_an_unwritable_place_warns_once_without_its_path_and_keeps_entries_in_memory(tmp_path):
    (tmp_path / "home").write_text("a file where a folder should be")
    path = tmp_path / "home" / "ledger.json"
    with pytest.warns(RuntimeWarning) as caught:
        ledger.record("01", "KV cache", "recompute", "one run each", "a", better=None, path=path)
        ledger.record("02", "paged", "contiguous", "one run each", "b", better=None, path=path)
    assert len(caught) == 1 and str(tmp_path) not in str(caught[0].message)
    assert [e.evidence for e in ledger.entries(path)] == ["a", "b"]


def test_a_damaged_file_is_reported_and_replaced(tmp_path):
    path = tmp_path / "l.json"
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="could not be read"):
        assert ledger.entries(path) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # warned once already
        ledger.record("09", "speculative decoding", "plain decoding", latency_verdict(0.5), "e", path=path)
    assert [e.decision for e in ledger.entries(path)] == ["Keep"]


def test_the_default_file_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("LABSUPPORT_LEDGER", raising=False)
    monkeypatch.setenv("LABSUPPORT_CACHE", str(tmp_path / "cache"))
    assert ledger.default_path() == tmp_path / "cache" / "ledger.json"
    monkeypatch.setenv("LABSUPPORT_LEDGER", str(tmp_path / "mine.json"))
    ledger.record("05", "chunked prefill", "whole prompts", "one run each", "e", better=None)
    assert [e.chapter for e in ledger.entries()] == ["05"] and (tmp_path / "mine.json").exists()


def test_an_empty_ledger_says_how_to_fill_it(tmp_path):
    shown = ledger.show(tmp_path / "none.json")
    assert "run the chapters" in shown.markdown() and "run the chapters" in shown._repr_html_()


def test_the_table_lists_every_column_and_escapes_what_would_break_it(tmp_path):
    path = tmp_path / "l.json"
    ledger.record("07", "1P+1D", "colocated", "colocated ahead", "shares 5/8 | 8/8 <b>", better=False, path=path)
    shown = ledger.show(path)
    md = shown.markdown()
    assert md.splitlines()[0] == "| ch. | technique | control | decision | evidence | recorded (UTC) |"
    assert "| 07 | 1P+1D | colocated | **Reject** | shares 5/8 \\| 8/8 <b> |" in md
    assert "&lt;b&gt;" in shown._repr_html_() and str(shown) == md


def test_a_saved_table_restores_the_entries_it_shows(tmp_path):
    path = tmp_path / "ledger.json"
    ledger.record("03", "prefix caching", "no cache", "fewer", "16 | 1,040 tokens (counts)", better=True, path=path)
    ledger.record("05", "chunked prefill", "whole prompts", None, "one run each: no verdict", path=path)
    shown = ledger.show(path)
    assert ledger.from_markdown(shown.markdown()) == ledger.entries(path)
    saved = {"cells": [{"cell_type": "code", "source": ["from labsupport import ledger\n", "\n", "ledger.show()"],
                        "outputs": [{"output_type": "execute_result",
                                     "data": {"text/markdown": shown.markdown(), "text/plain": str(shown)}}]}]}
    notebook = tmp_path / "09.ipynb"
    notebook.write_text(json.dumps(saved))
    other = tmp_path / "other.json"
    ledger.record("07", "1P+1D", "colocated", None, "e", path=other)
    restored = ledger.restore(notebook, other)
    assert restored == ledger.entries(other) == ledger.entries(path)  # 07 gone: the file is the table, whole
    with pytest.raises(ValueError, match="not a ledger row"):
        ledger.from_markdown("| 01 | KV cache |")
    saved["cells"] = []
    notebook.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="expected one saved"):
        ledger.restore(notebook, other)
