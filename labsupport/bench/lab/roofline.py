"""The roofline of this machine for this model, measured: how fast could a decode step possibly be?

A decode step must read every weight once (and each sequence's cached K/V) and do about
``2 * params`` FLOPs per sequence in the batch. So its time is at least the larger of

* bytes / read bandwidth: weights (+ KV) over what ``sum`` over a big tensor reaches, and
* ``2 * params * B`` / matmul rate: measured with the model's own linear shapes at M = B rows.

Both figures are measured here, not taken from a data sheet: a 2-core cloud VM shares memory
and turbo with its neighbours, and the only honest ceiling is the one just observed. Each is
the best of a few rounds (a ceiling, not a typical value). Two traps are avoided: the tensor
for bandwidth is *filled* first (untouched ``torch.empty`` pages all map to the kernel's zero
page, which sits in cache and reads at a fake rate far above memory's), and it is 256 MB, far beyond L3.
Each linear shape is timed alone, its weights hot in cache where they fit (all but the 113 MB
``lm_head``), so the compute term is optimistic too, and ``achieved = floor / measured`` says how
close an engine comes. The rates are the faster of ``torch``'s own ``F.linear`` (what transformers
calls) and, in fp32 on an x86 CPU, oneDNN on a weight packed in its own layout (what our engine calls,
``models/llama.py``); measured with ``F.linear`` alone, our prefill came out above the "roof". An
engine with better small-M kernels, vLLM's among them, can still pass 100 %.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ...kernels import cpu_ops
from ...models.llama import ModelConfig
from ...kernels.products import pack_weight, packed_copy, product

DECODE_BATCHES = (1, 4, 16, 32, 64)
PREFILL_SHAPE = (2048, 576, 1536)  # M x K x N: a 2048-token prefill through a SmolLM2-sized MLP
BANDWIDTH_BYTES = 256 << 20


def other_runnable(samples: int = 5, interval_s: float = 0.1) -> float | None:
    """Threads runnable besides this one, averaged over half a second (``/proc/stat``).

    On a 2-core machine even one busy neighbour ruins multi-threaded timings: torch's OpenMP
    threads spin-wait for a descheduled partner, and runs take many times longer."""
    if not os.path.exists("/proc/stat"):
        return None
    seen = []
    for _ in range(samples):
        with open("/proc/stat") as f:
            seen += [int(line.split()[1]) - 1 for line in f if line.startswith("procs_running")]
        time.sleep(interval_s)
    return sum(seen) / len(seen) if seen else None


def warn_if_busy() -> float | None:
    """Print a warning when other work competes for the cores; return how much (threads)."""
    busy = other_runnable()
    if busy is not None and busy >= 0.5:
        print(f"warning: about {busy:.1f} other runnable threads on {os.cpu_count()} cores: with "
              f"{torch.get_num_threads()} torch threads the timings below will be far too slow. "
              "Measure on an idle machine.", flush=True)
    return busy


def model_facts(folder) -> dict:
    """Shapes and sizes of the model in ``folder`` (its config.json; fp32 weights)."""
    cfg = ModelConfig.from_hf(json.loads((Path(folder) / "config.json").read_text()))
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    # (K, N, how many in the whole model): the matmuls one token goes through
    shapes = {"q_proj": (d, q, cfg.num_layers), "k_proj+v_proj": (d, kv, 2 * cfg.num_layers),
              "o_proj": (q, d, cfg.num_layers), "gate_proj+up_proj": (d, cfg.intermediate_size, 2 * cfg.num_layers),
              "down_proj": (cfg.intermediate_size, d, cfg.num_layers), "lm_head": (d, cfg.vocab_size, 1)}
    matmul_params = sum(k * n * c for k, n, c in shapes.values())
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * d  # a lookup: a few rows are read
    norms = (2 * cfg.num_layers + 1) * d
    return {"shapes": shapes, "matmul_params": matmul_params, "params": matmul_params + embed + norms,
            "weight_bytes": 4 * (matmul_params + norms),  # what one decode step must read (fp32)
            "kv_bytes_per_token": 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4}


def _best_seconds(fn, min_time: float, rounds: int = 3) -> float:
    """Best per-call time over ``rounds`` rounds, each at least ``min_time / rounds`` long."""
    fn()  # warm-up: allocations, oneDNN primitive creation
    best = math.inf
    for _ in range(rounds):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time / rounds:
                break
        best = min(best, elapsed / calls)
    return best


def _bandwidth_seconds(min_time: float) -> tuple[float, float]:
    """Seconds to sum, and to copy, a filled 256 MB tensor (both freed on return)."""
    data = torch.ones(BANDWIDTH_BYTES // 4)  # filled: every page really in memory
    dst = torch.zeros_like(data)
    return _best_seconds(lambda: data.sum(), min_time), _best_seconds(lambda: dst.copy_(data), min_time)


def _linear_seconds(x, w, min_time: float) -> float:
    """Best time of ``x @ w.T``: ``F.linear``, or what our engine runs (``products.product``: the C++ kernels
    for up to 128 rows, ``kernels/cpu_products.py``, oneDNN beyond, on the copy ``pack_cpu_weights`` would make)."""
    seconds = _best_seconds(lambda: F.linear(x, w), min_time)
    packed = pack_weight(w, packed_copy(w))
    if packed is not None:
        seconds = min(seconds, _best_seconds(lambda: product(x, w, None, packed), min_time))
    return seconds


def measure(folder, quick: bool = False, dtypes=("fp32", "bf16")) -> dict:
    """Measure bandwidths and matmul rates on this machine; derive decode-step floors for the model."""
    min_time = 0.04 if quick else 0.3
    facts = model_facts(folder)
    if not torch.cuda.is_available():  # time the products our CPU engine runs (built once; else PyTorch's)
        cpu_ops.build()
    read_s, copy_s = _bandwidth_seconds(min_time * 2)
    rates = {}
    for name in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        m, k, n = PREFILL_SHAPE
        x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        prefill = 2 * m * k * n / _linear_seconds(x, w, min_time) / 1e9
        decode, step_ms = {}, {}
        for rows in DECODE_BATCHES if name == "fp32" or not quick else ():
            seconds = 0.0
            for k, n, count in facts["shapes"].values():
                x, w = torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
                seconds += count * _linear_seconds(x, w, min_time / 4)
            decode[rows] = 2 * facts["matmul_params"] * rows / seconds / 1e9
            step_ms[rows] = seconds * 1e3
        rates[name] = {"prefill_gflops": prefill, "decode_gflops": decode, "decode_matmul_ms": step_ms}
    roof = {"read_gbps": BANDWIDTH_BYTES / read_s / 1e9, "copy_gbps": 2 * BANDWIDTH_BYTES / copy_s / 1e9,
            "bandwidth_tensor_mb": BANDWIDTH_BYTES >> 20, "prefill_shape_mkn": list(PREFILL_SHAPE),
            "matmul": rates, "threads": torch.get_num_threads(),
            "model": {k: v for k, v in facts.items() if k != "shapes"},
            "model_shapes_k_n_count": {k: list(v) for k, v in facts["shapes"].items()}}
    roof["decode_floor"] = {b: decode_floor(roof, b, context_len=256) for b in DECODE_BATCHES}
    return roof


def decode_floor(roof: dict, batch: int, context_len: float) -> dict:
    """Lower bound on one decode step of ``batch`` sequences of ``context_len`` cached tokens each."""
    model = roof["model"]
    kv_bytes = batch * context_len * model["kv_bytes_per_token"]
    t_bytes = (model["weight_bytes"] + kv_bytes) / (roof["read_gbps"] * 1e9)
    decode = roof["matmul"]["fp32"]["decode_gflops"]
    rows = min((m for m in decode if m >= batch), default=max(decode))  # nearest measured M at or above B
    t_compute = 2 * model["matmul_params"] * batch / (decode[rows] * 1e9)
    floor = max(t_bytes, t_compute)
    return {"batch": batch, "context_len": context_len, "kv_bytes": kv_bytes, "memory_ms": t_bytes * 1e3,
            "compute_ms": t_compute * 1e3, "floor_ms": floor * 1e3, "ceiling_tok_s": batch / floor,
            "bound": "memory" if t_bytes >= t_compute else "compute", "matmul_rows_measured": rows}


def achieved(roof: dict, tpot_s: float | None, batch: int, context_len: float, decode_tok_s: float | None = None):
    """Fraction of the floor an engine reached: from a TPOT (B=1) or a decode throughput (B>1)."""
    floor = decode_floor(roof, batch, context_len)
    if decode_tok_s:
        return decode_tok_s / floor["ceiling_tok_s"]
    return floor["floor_ms"] / 1e3 / tpot_s if tpot_s else None


def format_roofline(roof: dict) -> str:
    m = roof["model"]
    lines = [f"memory read {roof['read_gbps']:.1f} GB/s, copy {roof['copy_gbps']:.1f} GB/s "
             f"(filled {roof['bandwidth_tensor_mb']} MB tensor, {roof['threads']} threads)"]
    for name, r in roof["matmul"].items():
        dec = ", ".join(f"M={k}: {v:.1f}" for k, v in r["decode_gflops"].items())
        lines.append(f"{name} matmul GFLOP/s: prefill {'x'.join(map(str, roof['prefill_shape_mkn']))} "
                     f"{r['prefill_gflops']:.1f}" + (f"; model decode shapes {dec}" if dec else ""))
    lines.append("  (decode shapes: every linear layer of the model at M rows, weighted by how often it occurs)")
    lines.append(f"model: {m['params'] / 1e6:.1f} M params, {m['weight_bytes'] / 1e6:.0f} MB of weights read per "
                 f"step, {m['kv_bytes_per_token'] / 1e3:.1f} kB of KV per cached token")
    lines.append(f"{'B':>4} {'memory ms':>10} {'compute ms':>11} {'floor ms':>9} {'ceiling tok/s':>14}  bound"
                 "   (one decode step, 256 cached tokens per sequence)")
    for f in roof["decode_floor"].values():
        lines.append(f"{f['batch']:>4} {f['memory_ms']:>10.2f} {f['compute_ms']:>11.2f} {f['floor_ms']:>9.2f} "
                     f"{f['ceiling_tok_s']:>14.0f}  {f['bound']}")
    return "\n".join(lines)
