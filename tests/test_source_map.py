"""Chapter 08's map from our mechanisms to vLLM's source must point at code that exists.

vLLM renames and moves things between releases, so every cited path and name is checked against the
vLLM installed in ``.venv-vllm`` (those tests skip, saying why, without it), every cited labsupport path
and name against this repository, and the connector table must cover our ``KVConnectorBase`` method for
method. The checker itself is tested on a tiny fake package, so a lenient checker cannot pass a stale map.
"""
from __future__ import annotations

import inspect

import pytest

from labsupport.engine.kv_connector import KVConnectorBase
from labsupport.side_by_side import source_map as sm

ROOT = sm.vllm_root()
needs_vllm = pytest.mark.skipif(ROOT is None, reason="vLLM is not installed in .venv-vllm (`make vllm-env`): "
                                                     "the map's vLLM paths cannot be checked against its source")


@needs_vllm
def test_every_cited_vllm_path_and_name_exists():
    problems = sm.missing_paths()
    assert not problems, f"vLLM {sm.vllm_version(ROOT)} lacks:\n" + "\n".join(problems)


@needs_vllm
def test_the_installed_vllm_is_the_one_the_deck_talks_about():
    assert sm.vllm_version(ROOT), f"no version in {ROOT / '_version.py'}"


def test_every_cited_labsupport_path_and_name_exists():
    problems = sm.missing_ours()
    assert not problems, "\n".join(problems)


def test_every_method_of_our_connector_is_mapped_once():
    ours = {name for name, member in vars(KVConnectorBase).items() if callable(member) and not name.startswith("_")}
    assert set(sm.CONNECTOR_OURS_ONLY) <= ours, "an ours-only method that is not ours"
    ours -= set(sm.CONNECTOR_OURS_ONLY)
    mapped = [row["ours"] for row in sm.CONNECTOR_METHODS]
    assert sorted(mapped) == sorted(ours), f"unmapped: {ours - set(mapped)}; not ours: {set(mapped) - ours}"
    theirs = [row["vllm"] for row in sm.CONNECTOR_METHODS]
    assert len(set(theirs)) == len(theirs), "two of our methods map to one of vLLM's"
    for row in sm.CONNECTOR_METHODS:
        assert row["vllm"].startswith(sm.KV + "base.py:KVConnectorBase_V1."), row
        assert row["example"].split(".")[-1] == row["vllm"].split(".")[-1], row
        assert row["nixl"].startswith(sm.NIXL), row
        assert row["side"] in ("scheduler", "worker") and row["note"], row


def test_our_connector_methods_keep_vllms_argument_order():
    """Where the names agree, so do the leading arguments (vLLM's may have more, or richer types)."""
    same = {"get_num_new_matched_tokens": ["request", "num_computed_tokens"],
            "update_state_after_alloc": ["request", "block_ids", "num_external_tokens"],
            "request_finished": ["request", "block_ids"], "build_connector_meta": ["scheduler_output"]}
    for name, args in same.items():
        assert list(inspect.signature(getattr(KVConnectorBase, name)).parameters)[1:] == args, name


def test_tables_are_complete_rows():
    chapters = {row["chapter"] for row in sm.MECHANISMS}
    assert {f"{n:02d}" for n in range(8)} <= chapters, chapters
    for table, keys in ((sm.MECHANISMS, ("mechanism", "ours", "vllm", "differs")), (sm.NOT_IN_OURS, ("feature", "vllm", "what"))):
        for row in table:
            assert all(row[k] for k in keys), row
    assert len({row["mechanism"] for row in sm.MECHANISMS}) == len(sm.MECHANISMS)


FAKE = '''\
class Scheduler(
    Base,
):
    """A docstring with class Decoy in it."""

    max_num_seqs: int = 8

    def schedule(self):
        def helper():
            pass


def top_level(x: int,
              y: int) -> int:
    return x == y


Alias = Scheduler
'''


def test_the_checker_is_scoped_and_finds_aliases_fields_and_nested_defs(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(FAKE)
    ok = ["pkg/mod.py", "pkg/mod.py:Scheduler", "pkg/mod.py:Scheduler.schedule", "pkg/mod.py:Scheduler.max_num_seqs",
          "pkg/mod.py:Scheduler.schedule.helper", "pkg/mod.py:top_level", "pkg/mod.py:Alias", "pkg"]
    bad = ["pkg/other.py", "pkg/mod.py:schedule", "pkg/mod.py:Decoy", "pkg/mod.py:Scheduler.top_level",
           "pkg/mod.py:Scheduler.helper", "pkg/mod.py:x", "pkg:Scheduler", "pkg/mod.py:Schedule"]
    assert sm.missing(ok, tmp_path) == []
    problems = sm.missing(bad, tmp_path)
    assert len(problems) == len(bad), problems
    assert "in pkg/mod.py:Scheduler" in problems[3]


def test_missing_paths_without_vllm_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sm, "vllm_root", lambda venv=None: None)
    with pytest.raises(FileNotFoundError, match="make vllm-env"):
        sm.missing_paths()
    assert sm.vllm_root(tmp_path) is None


def test_as_markdown_renders_every_row_with_references_as_code():
    text = sm.as_markdown(sm.CONNECTOR_METHODS)
    lines = text.splitlines()
    assert len(lines) == 2 + len(sm.CONNECTOR_METHODS)
    assert lines[0].count("|") == lines[2].count("|") - lines[2].count("\\|")
    assert "`get_num_new_matched_tokens`" in text and "| scheduler |" in text
    table = sm.as_markdown([{"a": "x | y", "b": ["p.py:Q"]}])
    assert "x \\| y" in table and "`p.py:Q`" in table
    assert sm.as_markdown(sm.MECHANISMS, ["mechanism", "vllm"]).splitlines()[0] == "| mechanism | vllm |"


def test_every_row_of_not_in_ours_names_a_mechanism_our_code_lacks():
    """NOT_IN_OURS once listed speculative decoding, structured output and penalties, all in our engine: each row's
    entry-point pattern must match no code of labsupport/ (strings and comments aside)."""
    for row in sm.NOT_IN_OURS:
        found = sm.present_in_ours(row["absent"])
        assert not found, f"{row['feature']} is in ours after all:\n" + "\n".join(found)


def test_the_absence_check_finds_what_our_engine_does_have():
    """The patterns of mechanisms ours has must be found, so an empty answer above means absent, not a blind grep."""
    ours = {"speculative decoding": r"speculative_config", "structured output": r"structured_outputs",
            "penalties": r"presence_penalty", "priority scheduling": r"PriorityQueue",
            "KV cache events": r"BlockStored", "int4 weights": r"int4"}
    for what, pattern in ours.items():
        assert sm.present_in_ours(pattern), f"{what}: {pattern!r} not found in labsupport/"


def test_the_absence_check_reads_code_not_strings_or_comments(tmp_path):
    (tmp_path / "mod.py").write_text('"""We have no LoRA: lora_request is vLLM\'s."""\n'
                                     "x = 'lora_request'  # lora_request\n"
                                     "def run(lora_request=None):\n    return lora_request\n")
    found = sm.present_in_ours(r"\blora_request\b", tmp_path)
    assert [f.split(":")[:2] for f in found] == [["mod.py", "3"], ["mod.py", "4"]], found


def test_what_ours_has_is_in_the_mechanisms_table_not_in_not_in_ours():
    mapped = {row["mechanism"] for row in sm.MECHANISMS}
    assert {"Speculative decoding", "Structured output", "Penalties and logit bias", "Priority scheduling",
            "KV cache events"} <= mapped
    missing_ours = [f for f in ("Speculative decoding", "Structured output", "KV cache events")
                    if f in {row["feature"] for row in sm.NOT_IN_OURS}]
    assert not missing_ours, missing_ours
