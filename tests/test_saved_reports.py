"""Every benchmark command saves its ``--json`` through ``bench.summary.write_report``: the figures, and with them
the machine, the date and the command that made them, so a saved run can be read later (``benchmarks/README.md``
compares runs across days and machines). Model-free: the measurements are stood in for."""
import argparse
import json
import shlex
import sys
import time

from labsupport.bench import cli
from labsupport.bench.lab import quant, roofline
from labsupport.bench.summary import write_report


def test_a_report_carries_the_machine_the_date_and_the_command(tmp_path, capsys):
    path = tmp_path / "run.json"
    written = write_report(str(path), {"tok_s": 12.5, "rows": [1, 2]})
    saved = json.loads(path.read_text())
    assert saved == written and saved["tok_s"] == 12.5 and saved["rows"] == [1, 2]
    assert saved["date"] == time.strftime("%Y-%m-%d")
    assert saved["machine"]["cores"] > 0 and saved["machine"]["torch"] and "isa" in saved["machine"]
    assert saved["command"] == shlex.join(["python", *sys.orig_argv[1:]])
    assert f"wrote {path}" in capsys.readouterr().out


def test_what_a_run_records_itself_is_kept(tmp_path):
    """A GPU run records its device as its machine; a run dated at its start keeps that date."""
    gpu = {"device": "cuda", "device_name": "NVIDIA H200"}
    saved = write_report(str(tmp_path / "gpu.json"), {"machine": gpu, "date": "2026-11-30", "command": "make gpu-check"})
    assert saved["machine"] == gpu and saved["date"] == "2026-11-30" and saved["command"] == "make gpu-check"


def test_bench_quant_saves_through_it(tmp_path, monkeypatch):
    report = {"date": "2026-12-01", "machine": {"cpu": "stand-in"}, "methods": {"fp32": {}}}
    monkeypatch.setattr(quant, "run", lambda *a, **k: report)
    monkeypatch.setattr(quant, "format_table", lambda r: "the table")
    path = tmp_path / "quant.json"
    args = argparse.Namespace(methods="fp32", tokens=4, questions=None, ppl_tokens=None, batch=1, model=None,
                              threads=None, json=str(path))
    assert quant.main_from_args(args) == 0
    saved = json.loads(path.read_text())
    assert saved["methods"] == {"fp32": {}} and saved["machine"] == {"cpu": "stand-in"}
    assert saved["command"].startswith("python ")


def test_bench_roofline_saves_through_it(tmp_path, monkeypatch):
    monkeypatch.setattr(roofline, "measure", lambda folder, quick=False: {"bandwidth_gb_s": 30.0})
    monkeypatch.setattr(roofline, "format_roofline", lambda roof: "the roofline")
    monkeypatch.setattr(roofline, "warn_if_busy", lambda: 0)
    monkeypatch.setattr("labsupport.models.loader.resolve_model_path", lambda model: "a folder")
    path = tmp_path / "roofline.json"
    assert cli.main(["roofline", "--json", str(path)]) == 0
    saved = json.loads(path.read_text())
    assert saved["bandwidth_gb_s"] == 30.0 and saved["machine"]["cores"] > 0
    assert saved["date"] == time.strftime("%Y-%m-%d") and saved["command"].startswith("python ")
