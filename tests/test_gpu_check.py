"""``make gpu-check``'s script, tested where it can be: tiny sizes on the CPU (``--device cpu --quick``,
the kernel under triton's interpreter, in a child process so that the interpreter is set before
triton is imported), and the clean skip of every part on a machine without CUDA."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labsupport.bench.gpu import gpu_check, gpu_decode

PARTS = ("kernel", "decode", "w1")


def test_quick_run_on_the_cpu_reports_every_part(tmp_path):
    pytest.importorskip("triton", minversion="3.7", reason="the CPU runs the kernel under triton >= 3.7's interpreter")
    out = tmp_path / "gpu_check.json"
    run = subprocess.run([sys.executable, "-m", "labsupport.bench.gpu.gpu_check", "--device", "cpu", "--quick",
                          "--json", str(out)], cwd=Path(__file__).parents[1], capture_output=True, text=True,
                         timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["quick"] and report["copy_gb_s"] > 0
    kernel = report["kernel"]
    assert len(kernel["agreement"]) == 4 and all(row["ok"] for row in kernel["agreement"].values())
    assert set(kernel["timing"]) == set(gpu_decode.HEAD_SHAPES)
    for name in ("llama-3.1-8b", "smollm2-135m"):
        row = report["decode"][name]
        assert row["weight_bytes"] > 0 and row["kv_bytes"] > 0
        assert row["torch"]["step_ms"] > 0 and row["triton"]["step_ms"] > 0
    w1 = report["w1"]
    assert w1["torch"]["output_tok_s"] > 0 and w1["triton"]["output_tok_s"] > 0
    assert w1["same_tokens_triton_vs_torch"] >= 0.9  # fp32 on the CPU: the paths differ by ~1e-7
    less = report["compute_less"]
    assert less["ok"] and less["spec_identity"]["ngram"]["same_tokens"] and less["spec_identity"]["draft_model"]["same_tokens"]
    assert less["spec_identity"]["draft_model"]["acceptance_length"] > 3  # the model drafting for itself: all kept
    assert all(row["verify_ms"] > 0 and row["decode_ms"] > 0 for row in less["verify_cost"]["rows"].values())
    assert less["quantized_decode"]["int8"]["B=1_ms"] > 0 and less["quantized_decode"]["int4"]["paths"]
    chunked = report["chunked_prefill"]
    assert chunked["blocks_free"] and set(chunked["runs"]) == {"whole", "chunk 16", "chunk 32"}
    assert all(run["same_tokens_as_whole"] == 1.0 for run in chunked["runs"].values())  # fp32: the same tokens
    assert chunked["runs"]["chunk 16"]["steps"] > chunked["runs"]["whole"]["steps"]  # 64-token prompts in chunks
    assert chunked["runs"]["chunk 16"]["mixed_step_prompt_tokens"] <= 16
    for line in ("[1] kernel", "[2] decode step", "[3] W1", "[4] compute less", "[5] chunked prefill", "total"):
        assert line in run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the default device runs the full check")
def test_without_cuda_every_part_skips_and_says_why(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert gpu_check.main(["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for part in PARTS:
        assert "CUDA is not available" in report[part]["skipped"]
    assert "CUDA is not available" in capsys.readouterr().out
