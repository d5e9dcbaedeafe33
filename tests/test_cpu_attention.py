"""The CPU's compiled attention kernels (``kernels/cpu_attention.py``: decode and prefill) against
the PyTorch paths (the decode rows' gather, the prompts' one-at-a-time flash attention).

It needs a C++ compiler; where none is found the kernel is unavailable and these tests skip,
saying why (the engine then keeps the PyTorch path, which every other test covers). Tolerance:
fp32 in both, only the summation order differs.
"""
import random
from types import SimpleNamespace

import pytest
import torch

from labsupport import LLM, SamplingParams
from labsupport.bench.gpu.gpu_decode import random_decode_case as random_case
from labsupport.kernels import cpu_attention
from labsupport.engine.paged_attention import PagedAttention, paged_decode_attention

from conftest import PROMPTS


@pytest.fixture(scope="module")
def kernel():
    built, why_not = cpu_attention.available()
    if not built:
        pytest.skip(why_not)
    return cpu_attention.cpu_decode_attention


SHAPES = [  # heads, kv_heads, head_dim, block_size
    (9, 3, 64, 16),    # SmolLM2-135M: 3 query heads per KV head
    (32, 8, 128, 16),  # Llama-3.1-8B's grouping and head width
    (4, 4, 32, 4),     # no grouping, small blocks
    (4, 2, 32, 32),
]


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", SHAPES)
def test_kernel_equals_the_pytorch_gather(kernel, heads, kv_heads, head_dim, block_size):
    """Shuffled block tables padded with block 0 (random values there: an unmasked slot would show), contexts of
    one token, one short of a block, exactly a block, one over, several blocks."""
    lens = [1, max(block_size - 1, 1), block_size, block_size + 1, 3 * block_size + 5, 70]
    q, k, v, rows = random_case(lens, heads, kv_heads, head_dim, block_size, torch.float32)
    got = kernel(q, k, v, rows, block_size)
    want = paged_decode_attention(q, k, v, rows, block_size)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_non_contiguous_queries_and_other_dtypes(kernel):
    q, k, v, rows = random_case([5, 40], 9, 3, 64, 16, torch.float32, seed=3)
    strided = torch.cat([q, q], dim=-1)[..., :64]  # a view with a row stride twice its width, as a split leaves it
    torch.testing.assert_close(kernel(strided, k, v, rows, 16), paged_decode_attention(q, k, v, rows, 16),
                               atol=1e-5, rtol=1e-5)
    # not the kernels' type: the backend keeps the PyTorch paths
    assert cpu_attention.kernel_applies(torch.float32, 64) and not cpu_attention.kernel_applies(torch.bfloat16, 64)
    bf16 = PagedAttention(1, 4, 16, 3, 64, torch.bfloat16, "cpu", cpu_kernel=True)
    assert bf16.decode_attention is paged_decode_attention and bf16.prefill_kernel is None


def test_engine_with_the_kernel_gives_the_same_tokens_and_frees_every_block(kernel, llm):
    """Whole engines: decode-only steps, decode rows beside a prefill chunk (chunked prefill), prefix hits."""
    prompts = [PROMPTS[0], " ".join(PROMPTS[1:5]), " ".join(PROMPTS) * 3]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    gather = LLM(model=llm.engine.model_path, device="cpu", num_blocks=64, cpu_decode_kernel=False)
    try:
        assert gather.engine.backend.decode_attention is paged_decode_attention
        assert gather.engine.backend.prefill_kernel is None
        want = [o.token_ids for o in gather.generate(prompts, params, use_tqdm=False)]
    finally:
        gather.shutdown()
    fast = LLM(model=llm.engine.model_path, device="cpu", num_blocks=64,  # the kernel is the CPU's default
               enable_chunked_prefill=True, max_num_batched_tokens=32, enable_prefix_caching=True)
    try:
        assert fast.engine.backend.decode_attention is kernel
        assert fast.engine.backend.prefill_kernel is cpu_attention.cpu_prefill_attention
        for _ in range(2):  # the second time the prompts hit the prefix cache
            assert [o.token_ids for o in fast.generate(prompts, params, use_tqdm=False)] == want
        assert fast.engine.kv.allocator.num_free == fast.engine.kv.num_blocks  # cached blocks count as free
    finally:
        fast.shutdown()


def test_the_option_is_validated():
    with pytest.raises(ValueError, match="cpu_decode_kernel"):
        LLM(model=None, device="cpu", cpu_decode_kernel="yes")


def test_an_engine_without_the_kernel_warns_once_and_keeps_the_gather(llm, monkeypatch):
    """A laptop without a C++ compiler: every engine still serves, and says why only once per process."""
    monkeypatch.setattr(cpu_attention, "_module", None)
    monkeypatch.setattr(cpu_attention, "_why_not", "the CPU decode kernel could not be built (no compiler, simulated)")
    monkeypatch.setattr(cpu_attention, "_warned", False)
    engines = []
    with pytest.warns(UserWarning, match="no compiler, simulated.*keeps the PyTorch gather") as caught:
        for _ in range(2):
            engines.append(LLM(model=llm.engine.model_path, device="cpu", num_blocks=16))
    try:
        assert len([w for w in caught if "simulated" in str(w.message)]) == 1
        assert all(e.engine.backend.decode_attention is paged_decode_attention for e in engines)
        out = engines[1].generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert len(out[0].token_ids) == 4
    finally:
        for e in engines:
            e.shutdown()


def test_peaked_and_flat_softmax(kernel):
    """The kernel's own ``exp`` (a polynomial the compiler vectorises) over scores far apart, where most weights
    underflow to zero, and over equal scores, where they all count the same."""
    q, k, v, rows = random_case([300, 17, 129], 9, 3, 64, 16, torch.float32, seed=5)
    for scaled in (q * 40, q * 0):
        torch.testing.assert_close(kernel(scaled, k, v, rows, 16), paged_decode_attention(scaled, k, v, rows, 16),
                                   atol=1e-5, rtol=1e-5)


def test_head_sizes_off_the_vector_width_take_the_gather(kernel):
    """The backend chooses when it is built: heads of 24 floats are no whole number of vectors."""
    backend = PagedAttention(1, 4, 16, 2, 24, torch.float32, "cpu", cpu_kernel=True)
    assert backend.decode_attention is paged_decode_attention and backend.prefill_kernel is None
    q, k, v, rows = random_case([5, 21], 4, 2, 24, 16, torch.float32, seed=6)
    assert torch.equal(backend.decode_attention(q, k, v, rows, 16), paged_decode_attention(q, k, v, rows, 16))


def mixed_step(heads, kv_heads, head_dim, block_size, seed=0, dtype=torch.float32):
    """A backend with shuffled block tables and one step's worth of rows: fresh prompts (2 tokens, one short of a
    block, a block, several blocks and some), a chunk after 37 cached tokens, a chunk after exactly two blocks,
    and two decode rows; random q/k/v for the step's tokens."""
    gen = torch.Generator().manual_seed(seed)
    new = [2, max(block_size - 1, 2), block_size, 3 * block_size + 5, 70, 9, block_size + 3, 1, 1]
    cached = [0, 0, 0, 0, 0, 37, 2 * block_size, 20, 3 * block_size]
    need = [-(-(n + c) // block_size) for n, c in zip(new, cached)]
    blocks = list(range(sum(need) + 3))
    random.Random(seed).shuffle(blocks)
    backend = PagedAttention(1, len(blocks), block_size, kv_heads, head_dim, dtype, "cpu", cpu_kernel=True)
    for pool in (backend.k_pool[0], backend.v_pool[0]):  # what earlier steps left: the cached tokens' K/V
        pool.copy_(torch.randn(pool.shape, generator=gen))
    requests, at = [], 0
    for i, (n, c, b) in enumerate(zip(new, cached, need)):
        requests.append(SimpleNamespace(request_id=f"r{i}", block_table=blocks[at:at + b], num_computed_tokens=c))
        at += b
    t = sum(new)
    q, k, v = (torch.randn(t, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    return backend, requests, new, q, k, v


def step_output(backend, requests, new, q, k, v, kernel: bool):
    saved = backend.prefill_kernel
    backend.prefill_kernel = saved if kernel else None
    try:
        return backend.attend(0, q, k, v, backend.prepare(requests, new))
    finally:
        backend.prefill_kernel = saved


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", SHAPES)
@pytest.mark.parametrize("spread", [1.0, 40.0, 0.0])
def test_prefill_kernel_equals_one_sequence_at_a_time(kernel, heads, kv_heads, head_dim, block_size, spread):
    """Every prefill row of a mixed step, fresh prompts and chunks after a cached context, read in place in one
    call, against PyTorch's flash attention one sequence at a time (the chunks' contexts gathered), both measured
    from the same step in float64; the decode rows beside them are untouched. Scores far apart (most weights
    underflow, and fp32's rounding of scores in the hundreds shows in both) and all equal too."""
    backend, requests, new, q, k, v = mixed_step(heads, kv_heads, head_dim, block_size)
    assert backend.prefill_kernel is cpu_attention.cpu_prefill_attention
    got = step_output(backend, requests, new, q * spread, k, v, kernel=True)
    one_by_one = step_output(backend, requests, new, q * spread, k, v, kernel=False)
    exact = step_output(*mixed_step(heads, kv_heads, head_dim, block_size, dtype=torch.float64)[:3],
                        (q * spread).double(), k.double(), v.double(), kernel=False)
    error = lambda out: (out.double() - exact).abs().max().item()
    assert error(got) <= 2 * error(one_by_one) + 1e-5, (error(got), error(one_by_one))


def test_prefill_kernel_only_for_float32_whole_vectors(kernel):
    """bf16 pools and heads of 24 floats keep the per-sequence path, which answers as before."""
    assert mixed_step(9, 3, 64, 16, dtype=torch.bfloat16)[0].prefill_kernel is None
    backend, requests, new, q, k, v = mixed_step(4, 2, 24, 16)
    assert backend.prefill_kernel is None
    assert step_output(backend, requests, new, q, k, v, kernel=True).isfinite().all()
