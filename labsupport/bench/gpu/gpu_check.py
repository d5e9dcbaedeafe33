"""``make gpu-check``: what only a GPU can tell about this engine, in one prepared run that fits one GPU loan.

0. **parity**: greedy tokens of the engine (CUDA-graph decode and eager) equal transformers' on tiny
   random Llama and Qwen3 models, fp32 (``gpu_parity.py``).
1. **kernel**: the Triton paged-attention decode kernel (``kernels/triton_attention.py``) against
   the PyTorch path (``paged_decode_attention``), fp32 and bf16, at SmolLM2's and Llama-3.1-8B's
   head shapes (max abs error), and both timed at batch 64, context 1024.
2. **decode**: one decode step of the real engine pieces (``LlamaForCausalLM``, ``PagedAttention``,
   ``ModelRunner``) at batch 64, contexts 512-1024, for a Llama-3.1-8B- and a SmolLM2-135M-shaped
   model with random bf16 weights (and Qwen3-8B's shape). Reported as achieved memory bandwidth,
   (weights + KV read per step) / step time, and as a fraction of the device-to-device copy
   bandwidth measured here; the target is 70 %. Timed eagerly (Python launching every kernel) and
   through the engine's CUDA-graph decode (``kernels/cuda_graphs.py``: inputs copied into static
   buffers, then one graph replay), which is what the engine does on a GPU.
3. **w1**: bench compare's W1 shape (32 prompts x 200 tokens, 128 out each, greedy, ignore_eos)
   through the real ``LLM``/``LLMEngine`` with random SmolLM2-shaped weights: CUDA graphs + Triton (the
   engine's default on a GPU), Triton eager, PyTorch eager. (Parts 1-3: ``gpu_decode.py``.)
4. **compute less** (chapter 09, ``gpu_compute_less.py``): speculative decoding's greedy identity, the
   cost of verifying 1 + k tokens per sequence against decoding 1 (Llama-3.1-8B shape, by batch size),
   and a decode step with int8 / int4 weights against bf16.
5. **chunked prefill** (chapter 05, ``gpu_chunked_prefill.py``): the chapter's workload at its GPU scale
   on a Llama-3.1-8B-shaped model, unchunked and chunks of 256-2,048 tokens: the decoders' ITL, the long
   prompts' TTFT, and a decode-only step beside one carrying a chunk.

It needs no checkpoint, tokenizer, network or venv: models are random weights of the named shapes,
built on the device (``LLM(model="random:smollm2-135m")``, ``models/loader.py``). Without CUDA
every part says why it is skipped; ``--device cpu --quick`` runs tiny versions of all three on the
CPU (the kernel under triton's interpreter) so that the script itself is tested
(``tests/test_gpu_check.py``). Exit status 1 if the kernel disagrees or a part fails.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback

import torch

from .gpu_chunked_prefill import check_chunked_prefill, format_chunked_prefill
from .gpu_compute_less import check_compute_less, format_compute_less
from .gpu_decode import DECODE_MODELS, TARGET, check_decode, check_kernel, check_w1, copy_bandwidth
from .gpu_parity import check_parity

PART_NAMES = ("parity", "kernel", "decode", "w1", "compute_less", "chunked_prefill")


def parts(device, quick: bool, dtype, copy_bw: float) -> list[tuple[str, object, tuple]]:
    """The parts in the order this script runs them: (name, function, its arguments). ``gpu_preflight.py``
    runs the same list under its own deadline."""
    return [("parity", check_parity, (device, quick)), ("kernel", check_kernel, (device, quick)),
            ("decode", check_decode, (device, quick, dtype, copy_bw)), ("w1", check_w1, (device, quick, dtype)),
            ("compute_less", check_compute_less, (device, quick, dtype)),
            ("chunked_prefill", check_chunked_prefill, (device, quick, dtype))]


def parts_ok(report: dict) -> bool:
    """No part raised, and the parts that judge (parity, the kernel, compute less) said OK."""
    return (not any("error" in report.get(part, {}) for part in PART_NAMES)
            and all(report.get(part, {}).get("ok", True) for part in ("parity", "kernel", "compute_less")))


# ------------------------------------------------------------------ report

def run_part(name, fn, *args) -> dict:
    started = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["seconds"] = time.perf_counter() - started
    return result


def print_report(r: dict):
    print(f"== gpu-check on {r['machine']['device_name']} (torch {r['machine']['torch']}, "
          f"triton {r['machine']['triton']}){' [quick]' if r['quick'] else ''}")
    if "copy_gb_s" in r:
        print(f"copy bandwidth: {r['copy_gb_s']:.0f} GB/s (read + write)")
    p0 = r["parity"]
    print(f"[0] parity with transformers ({p0['seconds']:.0f} s): " + (p0.get("skipped") or p0.get("error") or
          ("OK" if p0["ok"] else "FAILED")))
    for spec, row in ((k, v) for k, v in p0.items() if isinstance(v, dict)):
        print(f"    {spec:18s} logits max diff {row['max_logit_diff']:.1e}; same greedy tokens: graphs "
              f"{row['graphs_same_tokens']:.0%} (on: {row['graphs_on']}), eager {row['eager_same_tokens']:.0%}; "
              f"blocks freed {row['graphs_blocks_free'] and row['eager_blocks_free']}")
    k = r["kernel"]
    print(f"[1] kernel ({k['seconds']:.0f} s): " + (k.get("skipped") or k.get("error") or
          f"{'OK' if k['ok'] else 'DISAGREES'}; engine's default decode path here: {k['engine_default_decode_path']}"))
    for case, row in k.get("agreement", {}).items():
        extra = (f" (vs fp32 math: kernel {row['kernel_vs_fp32']:.1e}, torch {row['torch_vs_fp32']:.1e})"
                 if "kernel_vs_fp32" in row else "")
        print(f"    {case:22s} max abs error {row['max_abs_error']:.1e}{extra} {'ok' if row['ok'] else 'FAIL'}")
    for name, t in k.get("timing", {}).items():
        print(f"    {name:14s} B={t['batch']} ctx={t['context']}: triton {t['triton_ms']:.3f} ms "
              f"({t['triton_kv_gb_s']:.0f} GB/s of KV), torch {t['torch_ms']:.3f} ms: x{t['speedup']:.1f}")
    d = r["decode"]
    print(f"[2] decode step ({d['seconds']:.0f} s): " + (d.get("skipped") or d.get("error") or
          f"B={d['batch']}, contexts {d['context_min_max'][0]}-{d['context_min_max'][1]}, target {TARGET:.0%} of copy"))
    for name in DECODE_MODELS:
        if name not in d:
            continue
        row = d[name]
        print(f"    {name}: reads {row['weight_bytes'] / 1e9:.2f} GB weights + {row['kv_bytes'] / 1e9:.2f} GB KV")
        for path in ("triton", "torch"):
            if path in row:
                p = row[path]
                graph = (f"; CUDA graph {p['graph_ms']:.2f} ms = {p['graph_gb_s']:.0f} GB/s = {p['graph_of_copy']:.0%}"
                         if "graph_ms" in p else f"; graph: {p['graph_error']}" if "graph_error" in p else "")
                print(f"      {path:6s} eager {p['step_ms']:.2f} ms = {p['gb_s']:.0f} GB/s = {p['of_copy']:.0%}{graph}")
    w = r["w1"]
    print(f"[3] W1 ({w['seconds']:.0f} s): " + (w.get("skipped") or w.get("error") or
          f"{w['requests']} x {w['prompt_tokens']} tokens, {w['max_tokens']} out, {w['model']}"))
    for path in ("triton+graphs", "triton", "torch"):
        if path in w:
            p = w[path]
            print(f"    {path:6s} {p['output_tok_s']:.0f} tok/s ({p['wall_s']:.2f} s), "
                  f"TPOT p50 {p['p50_tpot_ms']:.2f} ms, TTFT p50 {p['p50_ttft_ms']:.0f} ms")
    for key in (k for k in w if k.startswith("same_tokens_")):
        print(f"    {key.replace('_', ' ')}: {w[key]:.1%}")
    c = r.get("compute_less")
    if c is not None:
        print(f"[4] compute less ({c['seconds']:.0f} s): " + (c.get("skipped") or c.get("error")
                                                               or ("OK" if c["ok"] else "FAILED")))
        if "error" not in c and "skipped" not in c:
            print("\n".join(format_compute_less(c)))
    cp = r.get("chunked_prefill")
    if cp is not None:
        print(f"[5] chunked prefill ({cp['seconds']:.0f} s): " + (cp.get("skipped") or cp.get("error") or "OK"))
        if "error" not in cp and "skipped" not in cp:
            print("\n".join(format_chunked_prefill(cp)))
    print(f"total {r['seconds']:.0f} s; {'OK' if r['ok'] else 'FAILED'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m labsupport.bench.gpu.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (only sensible with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of the script, on any device")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the full report as JSON")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (decode_paths)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    has_device = device.type != "cuda" or torch.cuda.is_available()
    name = (torch.cuda.get_device_name(device) if device.type == "cuda" and has_device
            else platform.processor() or platform.machine())
    started = time.perf_counter()
    report = {"quick": args.quick, "machine": {"device": str(device), "device_name": name, "torch": torch.__version__,
                                                "triton": triton_version, "python": platform.python_version()}}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if not has_device:
        why = {"skipped": "CUDA is not available here (torch.cuda.is_available() is False): run it on a GPU "
                          "machine, or try the script with --device cpu --quick", "seconds": 0.0}
        report |= {"parity": why, "kernel": why, "decode": why, "w1": why}
    else:
        report["copy_gb_s"] = copy_bandwidth(device, (64 << 20) if args.quick else (1 << 30)) / 1e9
        for name, fn, fn_args in parts(device, args.quick, dtype, report["copy_gb_s"] * 1e9):
            report[name] = run_part(name, fn, *fn_args)
    report["ok"] = parts_ok(report)
    report["seconds"] = time.perf_counter() - started
    print_report(report)
    if args.json:
        from ..summary import write_report
        write_report(args.json, report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
