"""The GPU's code path, checked on the CPU: what can be checked of it without a GPU, in seconds, in ``make unit``.

1. **The CUDA kernel set composed** (in a child pytest under ``TRITON_INTERPRET=1``, as
   ``test_triton_attention.py`` explains): the model's kernels as ``kernels/select.py`` picks them for a CUDA
   device (fused RMSNorm, Triton RoPE and SiLU-and-multiply), the stacked projections, the attention kernels
   ``select.attention`` gives a CUDA device (the Triton decode kernel), and the graph executor's static-buffer
   forward (``DecodeGraphs(capture=False)``), all in one engine: its tokens and logits equal the plain eager
   engine's. Each piece has its own test elsewhere; this one catches pieces that disagree only together.
2. **The Triton kernels compiled ahead of time for sm_90** (``triton.compile`` with ``GPUTarget("cuda", 90, 32)``:
   triton's own CUDA compiler, ptxas included, needs no driver), in bf16, fp16 and fp32 at the head shapes the
   course runs, with the very constants the launch uses (``launch_options``, ``rope_constants``): a kernel that
   does not compile for Hopper, or needs more shared memory than a Hopper block has, fails here.
3. **A traced replay of a decode graph on refilled buffers**: the graph executor's forward recorded once
   (``make_fx``: every tensor it reads stays the same tensor, as a CUDA graph keeps addresses), the buffers
   refilled with another batch, the recording replayed: it must give that batch's logits. A value read into
   Python while recording (a width, a length) would be frozen into the graph; a planted one shows that it is.
"""
import dataclasses
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETING,
                                 reason="runs in the child pytest of test_kernel_set_under_the_interpreter")
compiled = pytest.mark.skipif(INTERPRETING, reason="ahead-of-time compiling needs triton's compiled kernels, not the "
                                                   "interpreter (runs in the parent pytest)")
ROOT = Path(__file__).parents[1]
BS = 16


# ------------------------------------------------------------------ 1. the kernel set, composed

@pytest.mark.skipif(INTERPRETING, reason="this is the child: the checks run directly")
def test_kernel_set_under_the_interpreter():
    pytest.importorskip("triton", minversion="3.7", reason="triton >= 3.7 runs the kernels on the CPU")
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "composed"],
                           cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                           timeout=300)
    print(child.stdout[-2000:])
    assert child.returncode == 0 and " passed" in child.stdout, child.stdout[-6000:] + child.stderr[-2000:]


@interpreted
def test_composed_cuda_kernel_set_equals_the_plain_eager_engine(monkeypatch):
    from labsupport import LLM, SamplingParams
    from labsupport.engine.paged_attention import PagedAttention, paged_decode_attention
    from labsupport.engine.runner import ModelRunner
    from labsupport.kernels import select, triton_attention
    from labsupport.kernels.cuda_graphs import DecodeGraphs
    from labsupport.models.loader import RANDOM_MODELS

    # SmolLM2's heads (9 query heads on 3 KV heads of 64), two thin layers: the kernels see the course's shapes
    monkeypatch.setitem(RANDOM_MODELS, "gpu-path", dataclasses.replace(
        RANDOM_MODELS["smollm2-135m"], num_layers=2, hidden_size=128, intermediate_size=256, vocab_size=512))
    prompts = [[(5 * i + j) % 500 + 1 for j in range(3 + 9 * i)] for i in range(3)]  # 3, 12, 21 tokens
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = LLM(model="random:gpu-path", device="cpu", num_blocks=32, block_size=BS, max_num_seqs=4,
                enforce_eager=True)
    plain.engine.model.use_kernels(select.plain())
    plain.engine.backend.decode_attention, plain.engine.backend.prefill_kernel = paged_decode_attention, None

    gpu = LLM(model="random:gpu-path", device="cpu", num_blocks=32, block_size=BS, max_num_seqs=4)
    engine, cfg, cuda = gpu.engine, gpu.engine.model.config, torch.device("cuda")
    engine.model.use_kernels(select.select(cuda, torch.float32))  # the GPU's set; nothing here touches a GPU
    assert engine.model.model.layers[0].self_attn.qkv is not None  # stacked projections, as on a GPU
    backend = PagedAttention(cfg.num_layers, 32, BS, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu",
                             scratch_block=True)
    backend.decode_attention, backend.prefill_kernel = select.attention(cuda, torch.float32, cfg.head_dim, False)
    assert backend.decode_attention is triton_attention.triton_decode_attention
    graphs = DecodeGraphs(engine.model, backend, 4, engine.max_model_len, capture=False, config=engine.config)
    engine.backend, engine.runner = backend, ModelRunner(engine.model, backend, engine.device, executor=graphs)
    replayed, run = [], graphs.run
    graphs.run = lambda batch: replayed.append(len(batch.requests)) or run(batch)

    want = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = gpu.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert replayed and max(replayed) == 3  # decode steps went through the graph executor, padded to bucket 4
    # and the numbers, not only the argmax: the last step's logits of one sequence, both ways
    ids = prompts[2] + want[2].token_ids
    from labsupport.engine.runner import sequence_logits
    torch.testing.assert_close(sequence_logits(engine.model, ids), sequence_logits(plain.engine.model, ids),
                               rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ 2. ahead of time, for sm_90

SM90_SHARED_BYTES = 232448  # the most shared memory one block may use on a Hopper GPU (227 KiB)
HEADS = {"smollm2-135m": (9, 3, 64), "llama-3.1-8b": (32, 8, 128), "tiny": (4, 2, 16), "tiny-qwen3": (4, 2, 32)}
# bf16 is what a GPU engine runs (every course shape); fp16 where bf16 is missing; fp32 for gpu-check's parity
DECODE_CASES = [("bfloat16", "smollm2-135m"), ("bfloat16", "llama-3.1-8b"), ("float16", "llama-3.1-8b"),
                ("float32", "smollm2-135m"), ("float32", "tiny"), ("float32", "tiny-qwen3")]
POINTER = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}


def compile_sm90(fn, signature: dict, constants: dict):
    triton = pytest.importorskip("triton", minversion="3.7", reason="triton's CUDA compiler")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    options = {k: constants.pop(k) for k in ("num_warps", "num_stages") if k in constants}
    signature = {**signature, **{name: "constexpr" for name in constants}}
    try:
        return triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32), options=options)
    except (RuntimeError, FileNotFoundError) as exc:
        if "ptxas" in str(exc) and "not found" in str(exc).lower():  # a triton wheel without its CUDA tools
            pytest.skip(f"triton cannot compile for CUDA without a driver here: {exc}")
        raise


def check_hopper_binary(kernel):
    assert kernel.asm["cubin"] and ".target sm_90" in kernel.asm["ptx"]
    assert kernel.metadata.shared <= SM90_SHARED_BYTES


@compiled
@pytest.mark.parametrize("dtype, shape", DECODE_CASES)
def test_decode_kernel_compiles_for_sm90(dtype, shape):
    from labsupport.kernels import triton_attention as ta
    h, hkv, d = HEADS[shape]
    pointers = {name: POINTER[dtype] for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    signature = {**pointers, "tables_ptr": "*i64", "lens_ptr": "*i64", "stride_qb": "i32", "stride_qh": "i32",
                 "stride_kh": "i32", "stride_ks": "i32", "stride_tb": "i32", "scale": "fp32"}
    constants = ta.launch_options(getattr(torch, dtype), h // hkv, d, BS, interpreted=False)
    check_hopper_binary(compile_sm90(ta._decode_kernel, signature, constants))


@compiled
@pytest.mark.parametrize("dtype, shape", [("bfloat16", "smollm2-135m"), ("bfloat16", "llama-3.1-8b"),
                                          ("float32", "tiny")])
def test_rope_and_silu_kernels_compile_for_sm90(dtype, shape):
    from labsupport.kernels import triton_ops
    h, hkv, d = HEADS[shape]
    pointer = POINTER[dtype]
    rope = {name: pointer for name in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "q_out", "k_out")}
    rope |= {name: "i32" for name in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_ct")}
    check_hopper_binary(compile_sm90(triton_ops._rope_kernel, rope, triton_ops.rope_constants(h, hkv, d)))
    silu = {"x_ptr": pointer, "out_ptr": pointer, "half": "i32"}
    check_hopper_binary(compile_sm90(triton_ops._silu_mul_kernel, silu, {"BLOCK": triton_ops.SILU_BLOCK}))


# ------------------------------------------------------------------ 3. a traced replay on refilled buffers

def _decode_requests(lens, vocab, num_blocks, seed):
    blocks = iter(random.Random(seed).sample(range(num_blocks), num_blocks))
    return [SimpleNamespace(request_id=f"r{i}", num_computed_tokens=n - 1, num_tokens=n,
                            all_token_ids=[(7 * i + j + seed) % vocab for j in range(n)],
                            block_table=[next(blocks) for _ in range(-(-n // BS))], params=SimpleNamespace(greedy=True))
            for i, n in enumerate(lens)]


def _recorded_executor(decode_fn=None):
    from labsupport.engine.paged_attention import PagedAttention, paged_decode_attention
    from labsupport.kernels.cuda_graphs import DecodeGraphs
    from labsupport.models.loader import RANDOM_MODELS, random_model

    cfg = RANDOM_MODELS["tiny"]
    model = random_model(cfg, "cpu", torch.float32)
    backend = PagedAttention(cfg.num_layers, 24, BS, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu",
                             scratch_block=True)
    backend.decode_attention = decode_fn or paged_decode_attention
    for pool in backend.k_pool + backend.v_pool:  # old KV everywhere: a wrong slot or mask shows
        pool.normal_()
    return DecodeGraphs(model, backend, 8, 8 * BS, capture=False), cfg


def _replay_versus_eager(graphs, cfg):
    from torch.fx.experimental.proxy_tensor import make_fx
    first = _decode_requests([5, 9, 3], cfg.vocab_size, 24, seed=0)
    second = _decode_requests([40, 2, 77, 18], cfg.vocab_size, 24, seed=1)  # wider, and one more row
    with torch.inference_mode():
        graphs._fill(first, 4)
        recorded = make_fx(lambda: graphs._forward(4))()  # no inputs: it reads the static buffers, as a graph does
        graphs._fill(second, 4)
        replay = recorded().clone()
        k_after_replay = [k.clone() for k in graphs.backend.k_pool]
        eager = graphs._forward(4)
    return replay, eager, k_after_replay, graphs.backend.k_pool


def test_traced_decode_graph_replays_a_refilled_batch():
    graphs, cfg = _recorded_executor()
    replay, eager, k_replayed, k_eager = _replay_versus_eager(graphs, cfg)
    torch.testing.assert_close(replay, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(k_replayed, k_eager):  # the replay wrote the second batch's K where eager writes it
        torch.testing.assert_close(a, b)


def test_traced_replay_catches_python_state_frozen_while_recording():
    """The check can fail: an executor that builds the padding mask from the batch's lengths kept in Python (as the
    eager path builds it) records the first batch's mask, and the refilled batch comes out wrong."""
    from labsupport.kernels.cuda_graphs import DecodeGraphs

    class MaskFromPython(DecodeGraphs):
        def _fill(self, requests, size):
            super()._fill(requests, size)
            self.lens = [r.num_computed_tokens + 1 for r in requests] + [1] * (size - len(requests))

        def _forward(self, size):
            from labsupport.kernels import cuda_graphs
            mask = torch.arange(self.max_blocks * BS)[None, :] >= torch.tensor(self.lens)[:, None]
            real = cuda_graphs.DecodeRows
            cuda_graphs.DecodeRows = lambda **fields: real(**{**fields, "padding": mask})
            try:
                return super()._forward(size)
            finally:
                cuda_graphs.DecodeRows = real

    graphs, cfg = _recorded_executor()
    graphs.__class__ = MaskFromPython
    replay, eager, _, _ = _replay_versus_eager(graphs, cfg)
    assert not torch.allclose(replay, eager, rtol=1e-3, atol=1e-3)


def test_recording_refuses_a_tensor_value_read_into_python():
    """A read of a tensor's value (``.item()``, ``int(...)``) while recording is refused outright, as a CUDA
    capture refuses the synchronisation it needs."""
    from labsupport.engine.paged_attention import paged_decode_attention

    def sized_by_python(q, k_pool, v_pool, rows, block_size):
        int(rows.context_lens.max())
        return paged_decode_attention(q, k_pool, v_pool, rows, block_size)

    graphs, cfg = _recorded_executor(sized_by_python)
    with pytest.raises(RuntimeError, match="data-dependent|value out of a tracing tensor"):
        _replay_versus_eager(graphs, cfg)
