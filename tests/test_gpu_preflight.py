"""``make gpu-preflight``'s CPU rehearsal: the very command the GPU runs first, on tiny float32 shapes, so a typo, a
missing key or a package the GPU image lacks shows here and not in the GPU's first minute. Plus the guards that
keep one failing or slow part from costing the others (``Preflight.run``), and the profile's batches covering
every feature the simulated clock fits."""
import importlib.metadata as md
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from labsupport.bench.gpu import gpu_preflight, gpu_profile
from labsupport.bench.gpu.gpu_probes import PROBES
from labsupport.sim.cost_model import FEATURES, features_of

ROOT = Path(__file__).parents[1]
IMAGE = ROOT / "labsupport" / "data" / "gpu_image_packages.txt"
PROFILE_KEYS = {"name", "source", "device", "machine", "date", "model", "dtype", "kv_cache_bytes", "coefficients",
                "fit", "notes"}


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    pytest.importorskip("triton", minversion="3.7", reason="the CPU runs the kernel under triton >= 3.7's interpreter")
    out = tmp_path_factory.mktemp("preflight")
    args = f"--device cpu --quick --out {out}"
    if shutil.which("make"):  # the Makefile's own line, as `make test` runs it
        cmd = ["make", "--no-print-directory", "gpu-preflight", f"PYTHON={sys.executable}",
               f"GPU_PREFLIGHT_ARGS={args}"]
    else:
        cmd = [sys.executable, "-m", "labsupport.bench.gpu.gpu_preflight", *args.split()]
    started = time.perf_counter()
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    return run, out, time.perf_counter() - started


@pytest.mark.slow
def test_rehearsal_writes_every_section_and_profile(rehearsal):
    run, out, seconds = rehearsal
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    report = json.loads((out / "preflight.json").read_text())
    assert report["ok"] and report["quick"] and report["seconds"] < report["deadline_s"]
    expected = {"versions", "profile smollm2-135m", "profile llama-3.1-8b", *(name for name, _ in PROBES),
                *(f"gpu_check {p}" for p in ("parity", "kernel", "compute_less", "chunked_prefill", "decode", "w1"))}
    assert set(report["parts"]) == expected and all(p["status"] == "ok" for p in report["parts"].values())
    v = report["versions"]
    assert v["torch"] and v["python"] and v["cpu_cores"] >= 1 and "triton" in v and "transformers" in v
    for shape in ("smollm2-135m", "llama-3.1-8b"):
        part = report["profile"][shape]
        profile = json.loads((out / part["file"]).read_text())
        assert part["file"] == f"cpu-rehearsal-{shape}.json" and set(profile) >= PROFILE_KEYS
        assert profile["source"] == "measured" and profile["dtype"] == "float32"
        assert set(profile["coefficients"]) == set(FEATURES) and all(c >= 0 for c in profile["coefficients"].values())
        assert profile["fit"]["n_steps"] == len(part["records"]) >= 20
        assert all(r["duration_s"] > 0 and set(FEATURES) <= set(r) for r in part["records"])
    probes = report["probes"]
    for spec in ("quick-smollm2-135m", "quick-llama-3.1-8b"):
        row = probes["recompute_and_cache"][spec]
        assert row["same_tokens"]  # float32: the KV cache changes nothing but the time
        for key in ("00_latency_growth", "01_kv_cache_speedup", "01_long_context_step"):
            assert set(row[key]) == {"value", "assert", "holds"} and row[key]["value"] > 0
    assert probes["raised_max_num_seqs"]["largest_replayed_batch"] == probes["raised_max_num_seqs"]["raised_to"]
    assert probes["capture_beside_copy"]["ok"] and probes["capture_beside_copy"]["same_tokens_share"] == 1.0
    assert probes["chunked_prefill"]["blocks_free"] and probes["engines_fit"]["default_engines"] == 2
    assert report["gpu_check"]["parity"]["ok"] and report["gpu_check"]["kernel"]["ok"]
    log = (out / "preflight.log").read_text()
    assert "== versions" in log and "== gpu_check w1" in log and "== done" in log


def _image_names() -> set[str]:
    names = set()
    for line in IMAGE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            names.add(line.split("==")[0].strip().lower().replace("_", "-"))
    return names


@pytest.mark.slow
def test_rehearsal_imports_only_what_the_gpu_image_has(rehearsal):
    """Each module the run imported is on the image: by its own name, by a distribution that provides it, or
    vendored inside setuptools (which the image has)."""
    run, out, _ = rehearsal
    assert run.returncode == 0, run.stdout[-3000:]
    image = _image_names()
    vendored = {p.name for p in (Path(md.distribution("setuptools").locate_file("setuptools")) / "_vendor").iterdir()}
    missing = {}
    for module, dists in json.loads((out / "preflight.json").read_text())["versions"]["imported_modules"].items():
        names = {module.lower().replace("_", "-"), *(d.lower().replace("_", "-") for d in dists)}
        if not names & image and module not in vendored:
            missing[module] = dists
    assert not missing, f"imported, but not on the GPU image ({IMAGE.name}): {missing}"


def test_a_failing_part_is_recorded_and_the_next_still_runs(tmp_path):
    import torch
    pre = gpu_preflight.Preflight(tmp_path, torch.device("cpu"), quick=True, deadline_s=60)
    pre.run("probes", "broken", "versions", lambda: 1 / 0)
    pre.run("probes", "fine", "engines_fit", lambda: {"answer": 42})
    report = json.loads((tmp_path / "preflight.json").read_text())
    assert report["probes"]["broken"]["error"].startswith("ZeroDivisionError")
    assert report["probes"]["fine"]["answer"] == 42 and report["parts"]["engines_fit"]["status"] == "ok"
    assert not report["ok"]


def test_a_part_past_its_time_is_stopped_and_one_past_the_deadline_not_started(tmp_path, monkeypatch):
    import torch
    monkeypatch.setattr(gpu_preflight, "QUICK_BUDGET_S", 0.3)
    monkeypatch.setattr(gpu_preflight, "MIN_START_S", 0.1)
    pre = gpu_preflight.Preflight(tmp_path, torch.device("cpu"), quick=True, deadline_s=0.6)
    started = time.perf_counter()
    pre.run("probes", "slow", "versions", lambda: time.sleep(5) or {})
    assert time.perf_counter() - started < 2  # the alarm interrupted the sleep
    time.sleep(0.4)  # now past the deadline
    pre.run("probes", "late", "engines_fit", lambda: {"ran": True})
    report = json.loads((tmp_path / "preflight.json").read_text())
    assert report["probes"]["slow"]["error"].startswith("stopped after")
    assert "not started" in report["probes"]["late"]["skipped"]
    assert report["parts"]["engines_fit"]["status"] == "skipped"


@pytest.mark.parametrize("quick", [False, True])
def test_profile_batches_let_the_fit_tell_every_feature_apart(quick):
    """Every feature varies, and no feature is a combination of others over the batches timed, so each
    coefficient is determined by the records (the fit's matrix has full column rank)."""
    shapes = gpu_profile.step_shapes(quick)
    x = np.array([[features_of(starts, fed)[f] for f in FEATURES] for _, starts, fed in shapes], dtype=float)
    assert np.linalg.matrix_rank(x / x.max(axis=0)) == len(FEATURES)
    assert all(sum(s + n for s, n in zip(starts, fed)) <= gpu_profile.MAX_TOKENS for _, starts, fed in shapes)
    labels = [label for label, _, _ in shapes]
    assert len(labels) == len(set(labels))


def test_stand_in_requests_own_disjoint_blocks_covering_their_tokens():
    reqs = gpu_profile.stand_ins([0, 30, 7], [17, 1, 40], vocab=100, first_block=1)
    blocks = [b for r in reqs for b in r.block_table]
    assert len(blocks) == len(set(blocks)) and min(blocks) == 1
    assert all(len(r.block_table) * gpu_profile.BLOCK_SIZE >= r.num_tokens == len(r.all_token_ids) for r in reqs)
    assert gpu_profile.blocks_for([("x", [0, 30, 7], [17, 1, 40])]) == len(blocks) + 1


@pytest.mark.parametrize("name, slug", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L40S", "l40s")])
def test_profiles_are_named_from_the_device(name, slug):
    import torch
    assert gpu_preflight.device_slug({"gpu_name": name}, torch.device("cuda")) == slug
    assert gpu_preflight.device_slug({}, torch.device("cpu")) == "cpu-rehearsal"
