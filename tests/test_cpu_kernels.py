"""The model's compiled CPU kernels (``kernels/cpu_ops.py``, ``kernels/cpu_products.py``): RoPE bit-identical
to ``apply_rope``, RMSNorm and SiLU-and-multiply and the thin and panel products equal to their PyTorch
reference to float32 rounding, and a whole engine giving the same tokens without them.

They need a C++ compiler; where none is found they are unavailable, these tests skip saying why, and
the model keeps PyTorch's code (which every other test covers).
"""
import pytest
import torch

from labsupport import SamplingParams
from labsupport.kernels import cpu_ops, jit, cpu_products, select
from labsupport.kernels.products import product
from labsupport.models.llama import Linear, ModelConfig, RMSNorm, apply_rope, rope_frequencies, use_kernels

from conftest import PROMPTS


@pytest.fixture(scope="module")
def built():
    ok, why_not = cpu_ops.build()
    if not ok:
        pytest.skip(why_not)


def angles(positions, head_dim, rope_scaling=None):
    cfg = ModelConfig(vocab_size=8, hidden_size=head_dim, intermediate_size=8, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=head_dim, rope_theta=500000.0, rope_scaling=rope_scaling or {})
    inv_freq, scaling = rope_frequencies(cfg)
    a = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((a, a), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", [(1, 9, 3, 64), (37, 9, 3, 64), (300, 32, 8, 128),
                                                               (5, 4, 4, 32)])
def test_rope_is_bit_identical_to_apply_rope(built, tokens, heads, kv_heads, head_dim):
    """q and k as the model makes them: strided views of one stacked q/k/v product, far and near positions."""
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim) * 3
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 100_000, (tokens,))
    cos, sin = angles(positions, head_dim, {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 8192})
    before = qkv.clone()
    got_q, got_k = cpu_ops.cpu_rope_qk(q, k, cos, sin)
    assert torch.equal(got_q, apply_rope(q, cos, sin)) and torch.equal(got_k, apply_rope(k, cos, sin))
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(qkv, before)  # its inputs are left as they were


def test_rope_declines_what_it_cannot_do(built):
    """Autograd watching, another dtype: the CPU's ``rope_qk`` falls back to ``apply_rope`` and gradients still flow."""
    q = torch.randn(3, 4, 32, requires_grad=True)
    k = torch.randn(3, 2, 32)
    cos, sin = angles(torch.arange(3), 32)
    assert cpu_ops.cpu_rope_qk(q, k, cos, sin) is None
    rq, rk = select.cpu().rope_qk(q, k, cos, sin)
    rq.sum().backward()
    assert q.grad is not None and torch.equal(rk, apply_rope(k, cos, sin))
    half = (q.detach().bfloat16(), k.bfloat16(), cos.bfloat16(), sin.bfloat16())
    assert cpu_ops.cpu_rope_qk(*half) is None


@pytest.mark.parametrize("n, k", [(960, 576), (3072, 576), (576, 1536), (49152, 576), (8, 16)])
def test_thin_product_equals_the_matrix_product(built, n, k):
    """One row up to ``thin_rows()``, with and without a bias (Qwen2's q/k/v), on a row slice of a stacked
    matrix as ``fuse_projections`` makes them; float64 is the judge."""
    torch.manual_seed(n)
    stacked = torch.randn(n + 8, k) * 0.05
    weight, bias = stacked[8:], torch.randn(n)
    assert cpu_products.thin_rows() >= 2
    for rows in range(1, cpu_products.thin_rows() + 1):
        x = torch.randn(rows, k)
        for b in (None, bias):
            got = cpu_products.thin_product(x, weight, b)
            want = x.double() @ weight.double().T + (0 if b is None else b.double())
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)
            torch.testing.assert_close(product(x, weight, b), got, rtol=0, atol=0)  # the model takes this path


def test_thin_product_declines_what_it_cannot_do(built):
    """More rows than it wins at, widths off its vectors, bf16, autograd watching: None, and ``product``
    gives the right answer by another path."""
    w = torch.randn(64, 32)
    too_many = torch.randn(cpu_products.thin_rows() + 1, 32)
    assert cpu_products.thin_product(too_many, w, None) is None
    assert cpu_products.thin_product(torch.randn(1, 24), torch.randn(64, 24), None) is None  # 24 % 16
    assert cpu_products.thin_product(torch.randn(1, 32), torch.randn(60, 32), None) is None  # 60 % 8
    assert cpu_products.thin_product(torch.randn(1, 32).bfloat16(), w.bfloat16(), None) is None
    assert cpu_products.thin_product(torch.randn(0, 32), w, None) is None
    x = torch.randn(1, 32, requires_grad=True)
    assert cpu_products.thin_product(x, w, None) is None
    product(x, w, None).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0)[None])


@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (49152, 576), (64, 40)])
def test_panel_product_equals_the_matrix_product(built, n, k):
    """Whole tiles of rows and a short last one (12 rows a tile with AVX-512, 6 with AVX2), with and without a
    bias, from panels of a row slice of a stacked matrix; float64 is the judge."""
    torch.manual_seed(n + k)
    stacked = torch.randn(n + 32, k) * 0.05
    weight, bias = stacked[32:], torch.randn(n)
    panels = cpu_products.pack_panels(weight)
    assert panels.shape == (n // cpu_products.panel_width(), k, cpu_products.panel_width())
    for rows in (4, 5, 12, 13, 31, cpu_products.PANEL_ROWS):
        x = torch.randn(rows, k)
        for b in (None, bias):
            got = cpu_products.panel_product(x, panels, b)
            want = x.double() @ weight.double().T + (0 if b is None else b.double())
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_a_linear_takes_the_panels_while_they_are_its_weight(built):
    """``pack_cpu_weights`` gives a whole-panel matrix panels (others oneDNN's layout); ``product`` reads them up
    to ``PANEL_ROWS`` rows, takes oneDNN beyond, and the plain weight once it is rewritten or replaced."""
    from labsupport.kernels import products
    torch.manual_seed(0)
    width = cpu_products.panel_width()  # 32 with AVX-512, 16 with AVX2
    if not width:
        pytest.skip("no panel product on this CPU (neither AVX-512 nor AVX2)")
    panelled, odd = Linear(48, 6 * width, bias=True), Linear(48, 5 * width + 8, bias=False)
    both = torch.nn.Sequential(panelled, odd)
    products.pack_cpu_weights(both, {})
    use_kernels(both, select.cpu())
    assert panelled.packed[0].dim() == 3 and not panelled.packed[0].is_mkldnn  # panels
    assert odd.packed is None or odd.packed[0].is_mkldnn  # not whole panels: oneDNN's layout
    with torch.inference_mode():
        for rows in (4, 9, cpu_products.PANEL_ROWS, cpu_products.PANEL_ROWS + 1, 600):
            x = torch.randn(rows, 48)
            for m in (panelled, odd):
                torch.testing.assert_close(m(x), torch.nn.functional.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
        x = torch.randn(7, 48)
        assert torch.equal(panelled(x), cpu_products.panel_product(x, panelled.packed[0], panelled.bias))
        panelled.weight.mul_(2)  # written in place: the panels are stale and must not be read
        torch.testing.assert_close(panelled(x), torch.nn.functional.linear(x, panelled.weight, panelled.bias),
                                   rtol=1e-5, atol=1e-5)


def test_panel_product_declines_what_it_cannot_do(built):
    panels = cpu_products.pack_panels(torch.randn(64, 32))
    assert cpu_products.pack_panels(torch.randn(40, 32)) is None  # 40 rows: not whole panels
    assert cpu_products.pack_panels(torch.randn(64, 32).bfloat16()) is None
    assert cpu_products.panel_product(torch.randn(cpu_products.PANEL_ROWS + 1, 32), panels, None) is None
    assert cpu_products.panel_product(torch.randn(5, 24), panels, None) is None  # K does not match
    assert cpu_products.panel_product(torch.randn(5, 32, requires_grad=True), panels, None) is None


@pytest.mark.parametrize("rows, features", [(1, 576), (3, 24), (32, 64), (257, 960), (2048, 4096)])
def test_rms_norm_equals_the_reference(built, rows, features):
    """``RMSNorm`` with the CPU's kernels, in float32, runs the C++ pass: within a few units in the last place of the reference
    lines (transformers' ``LlamaRMSNorm``) at any scale of the input and any width (24: not whole vectors),
    on a strided view too. With autograd watching it runs ``F.rms_norm``, which is the reference to the bit."""
    torch.manual_seed(rows)
    norm = RMSNorm(features, 1e-5)
    norm.weight.data = torch.randn(features)
    use_kernels(norm, select.cpu())
    for scale in (1e-3, 1.0, 1e3):
        x = torch.randn(rows, 2 * features)[:, ::2] * scale  # every other column: not contiguous
        reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))
        with torch.inference_mode():
            got = norm(x)
            assert torch.equal(got, cpu_ops.cpu_rms_norm(x, norm.weight, norm.eps))  # the kernel's path
        torch.testing.assert_close(got, reference.detach(), rtol=1e-6, atol=0)
        assert torch.equal(norm(x), reference)  # autograd watching the weight: F.rms_norm, bit for bit


def test_silu_mul_equals_the_reference(built):
    """``silu(gate) * up`` of a stacked [T, 2I] product: large, small, negative and zero inputs."""
    torch.manual_seed(0)
    for rows, inner in ((1, 1536), (5, 24), (300, 1536)):
        gate_up = torch.randn(rows, 2 * inner) * 4
        gate_up[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-8, -200.0])
        gate, up = gate_up.double().chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
        torch.testing.assert_close(cpu_ops.cpu_silu_mul(gate_up).double(), want, rtol=2e-6, atol=1e-30)
    assert cpu_ops.cpu_silu_mul(torch.randn(2, 8, requires_grad=True)) is None  # autograd: PyTorch's path
    assert cpu_ops.cpu_silu_mul(torch.randn(2, 8).bfloat16()) is None
    assert cpu_ops.cpu_rms_norm(torch.randn(2, 8).bfloat16(), torch.ones(8).bfloat16(), 1e-5) is None


def test_an_engine_gives_the_same_tokens_without_the_kernel(built, llm, monkeypatch):
    """Whole engine, prefill and decode at batch 1 and 3 (thin products), 5 and 10 (panels): the kernels change
    no token, and logprobs only in float32's last places (they sum in another order than oneDNN)."""
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    with_kernels = [llm.generate(PROMPTS[:b], params, use_tqdm=False) for b in (1, 3, 5, 10)]
    monkeypatch.setitem(jit._built, cpu_ops.NAME, (None, "switched off by the test"))
    without = [llm.generate(PROMPTS[:b], params, use_tqdm=False) for b in (1, 3, 5, 10)]
    for a, b in zip(sum(with_kernels, []), sum(without, [])):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-3 for t in la)


@pytest.mark.parametrize("vectors", ["avx2", "portable"])
def test_the_other_instruction_sets_compute_the_same(built, vectors):
    """This machine builds the AVX-512 kernels; a laptop builds AVX2 (6 x 16 panels, 8-wide vectors) or, on Arm,
    the compiler's portable vectors. Both are built here from the same sources and checked like the default."""
    import platform
    from torch.utils.cpp_extension import load_inline
    from labsupport.engine.paged_attention import paged_decode_attention
    from labsupport.bench.gpu.gpu_decode import random_decode_case
    if vectors == "avx2" and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("AVX2 is x86's")
    flags = ["-O3", "-fopenmp"] + (["-mavx2", "-mfma"] if vectors == "avx2" else [])

    def build(name, files, functions, cflags):
        # in our build folders, under our build lock: a run killed mid-build (a cancelled CI job) left torch's
        # baton in its default folder, and every later run of this test waited on it forever
        directory = jit._build_directory(name)
        with jit.exclusive_build(directory):
            return load_inline(name, cpp_sources=jit.sources(files), functions=functions, extra_cflags=cflags,
                               extra_ldflags=["-fopenmp"], extra_include_paths=[str(jit.CSRC)],
                               build_directory=directory)

    model = build(f"labsupport_test_model_{vectors}", ["model_ops.cpp", "products.cpp"],
                  ["rms_norm", "silu_mul", "thin_product", "panel_product", "vector_width"],
                  flags + ["-ffp-contract=off"])
    decode = build(f"labsupport_test_attention_{vectors}", ["paged_decode.cpp", "paged_prefill.cpp"],
                   ["paged_decode", "paged_prefill"], flags)
    width = 2 * model.vector_width()
    assert width == 16
    x, weight = torch.randn(3, 40) * 3, torch.randn(40)  # 40: two vectors and a tail of 8 with AVX-512, 5 with AVX2
    torch.testing.assert_close(model.rms_norm(x, weight, 1e-5), cpu_ops.cpu_rms_norm(x, weight, 1e-5),
                               rtol=1e-6, atol=0)
    torch.testing.assert_close(model.silu_mul(x), cpu_ops.cpu_silu_mul(x), rtol=1e-6, atol=1e-30)
    torch.manual_seed(1)
    for n, k in [(960, 576), (576, 1536), (64, 40)]:
        weight, bias = torch.randn(n, k) * 0.05, torch.randn(n)
        panels = weight.reshape(n // width, width, k).transpose(1, 2).contiguous()
        for rows in (1, 2, 5, 6, 7, 13, 128):
            x = torch.randn(rows, k)
            want = x.double() @ weight.double().T + bias.double()
            torch.testing.assert_close(model.panel_product(x, panels, bias).double(), want, rtol=1e-5,
                                       atol=1e-5 * k ** 0.5)
            if rows <= 2 and k % 16 == 0:
                torch.testing.assert_close(model.thin_product(x, weight, bias).double(), want, rtol=1e-5,
                                           atol=1e-5 * k ** 0.5)
    for heads, kv_heads, head_dim, block_size in [(9, 3, 64, 16), (32, 8, 128, 16), (4, 4, 32, 4)]:
        q, k, v, rows = random_decode_case([1, block_size + 1, 3 * block_size + 5, 300], heads, kv_heads, head_dim,
                                           block_size, torch.float32)
        got = decode.paged_decode(q, k, v, rows.block_tables, rows.context_lens, block_size, head_dim ** -0.5)
        torch.testing.assert_close(got, paged_decode_attention(q, k, v, rows, block_size), atol=1e-5, rtol=1e-5)
        # the prefill kernel, on a mixed step (test_cpu_attention.py), against the one-sequence-at-a-time path
        from test_cpu_attention import mixed_step, step_output
        backend, requests, new, q, k, v = mixed_step(heads, kv_heads, head_dim, block_size)
        backend.prefill_kernel = lambda q, kp, vp, s, bs, out: decode.paged_prefill(
            q, kp, vp, s.block_tables, s.starts, s.query_lens, s.context_lens, bs, head_dim ** -0.5, out)
        torch.testing.assert_close(step_output(backend, requests, new, q, k, v, kernel=True),
                                   step_output(backend, requests, new, q, k, v, kernel=False), atol=2e-5, rtol=1e-5)
