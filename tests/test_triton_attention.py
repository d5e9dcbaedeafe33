"""The Triton paged-attention decode kernel against the PyTorch path, on the CPU, under triton's interpreter.

How the interpreter is switched on, robustly: ``TRITON_INTERPRET=1`` must be set before triton
is *imported* (the combine functions of ``tl.max`` and ``tl.sum`` are ``@triton.jit`` functions
themselves, compiled or interpreted as triton defined them at import), and once set it holds for
every later triton kernel of the process. Within one pytest process neither can be promised
(another test may have imported triton; a later one may want compiled kernels on a GPU). So
``test_under_the_interpreter`` runs this file again in a child pytest with the variable set from
the start, and the checks below run there; in the parent they are skipped with that reason. (Run
with ``TRITON_INTERPRET=1`` set yourself, they run directly.)

Tolerances: fp32 in, fp32 arithmetic in both paths, different summation order only: 1e-5.
bf16/fp16 round differently in the two paths (the PyTorch one rounds scores and probabilities to
the input type; the kernel keeps them in fp32), so each is compared to an fp32 reference computed
from the same rounded inputs, and must be at least about as close to it as the PyTorch path.
"""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labsupport import SamplingParams
from labsupport.bench.gpu.gpu_decode import random_decode_case as random_case
from labsupport.engine.paged_attention import paged_decode_attention

from conftest import PROMPTS

pytest.importorskip("triton", minversion="3.7",
                    reason="triton >= 3.7 runs this kernel on the CPU (older interpreters fail with numpy 2.4)")
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the child pytest of test_under_the_interpreter")


@pytest.mark.skipif(INTERPRETING, reason="this is the child: the checks run directly")
def test_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                           cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=300)
    print(child.stdout[-2000:])
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]


@pytest.fixture(scope="module")
def kernel():
    import labsupport.kernels.triton_attention as module
    assert module.INTERPRETED and type(module._decode_kernel).__name__ == "InterpretedFunction"
    assert module.available("cpu")
    return module


SHAPES = [  # heads, kv_heads, head_dim, block_size
    (9, 3, 64, 16),    # SmolLM2-135M: 3 query heads per KV head
    (32, 8, 16, 16),   # Llama-3.1-8B's grouping (4 per KV head), small head_dim
    (4, 4, 32, 4),     # no grouping, blocks smaller than the kernel's tile
    (4, 2, 32, 128),   # blocks larger than the kernel's tile
]


def context_lengths(block_size):
    return [1, max(block_size - 1, 1), block_size, block_size + 1, 3 * block_size + 5, 70]  # 70: two 64-token tiles


@interpreted
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", SHAPES)
def test_kernel_equals_pytorch_path_fp32(kernel, heads, kv_heads, head_dim, block_size):
    q, k, v, rows = random_case(context_lengths(block_size), heads, kv_heads, head_dim, block_size, torch.float32)
    got = kernel.triton_decode_attention(q, k, v, rows, block_size)
    want = paged_decode_attention(q, k, v, rows, block_size)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, dtype", [
    (9, 3, 64, 16, torch.bfloat16), (32, 8, 16, 16, torch.bfloat16), (9, 3, 64, 16, torch.float16)])
def test_kernel_equals_pytorch_path_half(kernel, heads, kv_heads, head_dim, block_size, dtype):
    q, k, v, rows = random_case(context_lengths(block_size), heads, kv_heads, head_dim, block_size, dtype, seed=1)
    got = kernel.triton_decode_attention(q, k, v, rows, block_size)
    assert got.dtype == dtype
    exact = paged_decode_attention(q.float(), k.float(), v.float(), rows, block_size)
    torch_error = (paged_decode_attention(q, k, v, rows, block_size).float() - exact).abs().max().item()
    kernel_error = (got.float() - exact).abs().max().item()
    assert kernel_error <= max(1.5 * torch_error, 1e-2), (kernel_error, torch_error)


@interpreted
def test_kernel_steps_back_to_pytorch_for_what_it_cannot_do(kernel):
    """A block size of 12 (not a power of two): the PyTorch path's answer, and a warning saying why, once."""
    q, k, v, rows = random_case([5, 30], 2, 1, 32, 12, torch.float32)
    with pytest.warns(RuntimeWarning, match="power-of-two block sizes"):
        got = kernel.triton_decode_attention(q, k, v, rows, 12)
    torch.testing.assert_close(got, paged_decode_attention(q, k, v, rows, 12))
    graph_rows = dataclasses.replace(rows, padding=None)  # as CUDA graphs hand it: the mask made from the lengths
    torch.testing.assert_close(kernel.triton_decode_attention(q, k, v, graph_rows, 12), got)


@interpreted
def test_kernel_that_fails_to_compile_steps_back_once_and_for_good(kernel, monkeypatch):
    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("PassManager::run failed (a compile error planted by the test)")
            return launch

    q, k, v, rows = random_case([7, 19], 4, 2, 16, 16, torch.float16)
    monkeypatch.setattr(kernel, "_decode_kernel", Broken())
    monkeypatch.setattr(kernel, "_FAILED", {})
    monkeypatch.setattr(kernel, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="PassManager"):
        got = kernel.triton_decode_attention(q, k, v, rows, 16)
    torch.testing.assert_close(got, paged_decode_attention(q, k, v, rows, 16))
    assert list(kernel._FAILED) == [(torch.float16, 2, 16, 16)]
    kernel.triton_decode_attention(q, k, v, rows, 16)  # no second warning, no second try


@interpreted
def test_a_failure_of_a_kernel_that_once_ran_still_raises(kernel, monkeypatch):
    q, k, v, rows = random_case([5], 2, 1, 16, 16, torch.float32)
    kernel.triton_decode_attention(q, k, v, rows, 16)  # compiles and runs: its key is now known good

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("a launch failure the kernel must not hide")
            return launch

    monkeypatch.setattr(kernel, "_decode_kernel", Broken())
    with pytest.raises(RuntimeError, match="must not hide"):
        kernel.triton_decode_attention(q, k, v, rows, 16)


@interpreted
def test_engine_gives_the_same_greedy_tokens_with_the_kernel(kernel, llm, monkeypatch):
    """The whole engine (30 layers, prefill then decode steps) with the kernel in place of the gather."""
    prompts = [PROMPTS[0], " ".join(PROMPTS[1:5])]  # 5 and 24 tokens: one and two 16-token blocks
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)  # a prefill, two decode steps
    default = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(llm.engine.backend, "decode_attention", kernel.triton_decode_attention)
    with_kernel = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in with_kernel] == [o.token_ids for o in default]


@interpreted
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (32, 8, 128), (4, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kernel_equals_apply_rope(heads, kv_heads, head_dim, dtype):
    """q and k as the model hands them over: non-contiguous views of one stacked q/k/v product."""
    import labsupport.kernels.triton_ops as module
    from labsupport.models.llama import LlamaForCausalLM, apply_rope
    from labsupport.models.loader import RANDOM_MODELS
    import dataclasses
    assert module.INTERPRETED and module.available("cpu")
    cfg = dataclasses.replace(RANDOM_MODELS["llama-3.1-8b"], num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                              hidden_size=heads * head_dim, num_layers=1, vocab_size=8)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    from labsupport.models.llama import rope_frequencies
    model.inv_freq, model.rope_scaling = rope_frequencies(cfg)
    positions = torch.tensor([0, 1, 7, 300, 5000, 131000])
    cos, sin = model.rope_cos_sin(positions, dtype)
    t = len(positions)
    stacked = torch.randn(t, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, _ = stacked.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim)
    got_q, got_k = module.triton_rope_qk(q, k, cos, sin)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the kernel rounds once, apply_rope after each op
    torch.testing.assert_close(got_q.float(), apply_rope(q.float(), cos.float(), sin.float()), rtol=tol, atol=tol)
    torch.testing.assert_close(got_k.float(), apply_rope(k.float(), cos.float(), sin.float()), rtol=tol, atol=tol)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_kernel(dtype):
    import torch.nn.functional as F
    import labsupport.kernels.triton_ops as module
    gate_up = torch.randn(5, 2 * 1500).to(dtype)  # not a multiple of the kernel's block
    gate, up = gate_up.float().chunk(2, dim=-1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(module.triton_silu_mul(gate_up).float(), F.silu(gate) * up, rtol=tol, atol=tol)
