"""Small decode steps on the CPU, one C++ call per layer (``kernels/cpu_decode_layers.py``): the same tokens and
the same logprobs as the Python layers, bit for bit, and the Python layers wherever the C++ layer must step
aside (more rows than the thin products take, an exercise's attention plugged in, quantized weights,
``enforce_eager``). Qwen2's q/k/v bias runs through it in ``tests/test_model_variants.py`` (tokens equal to
transformers'); Qwen3's q/k norm declines it there."""
import pytest

from labsupport import LLM, SamplingParams
from labsupport.engine.runner import EagerStep
from labsupport.kernels import cpu_decode_layers
from labsupport.engine.paged_attention import paged_decode_attention

from conftest import PROMPTS

PARAMS = SamplingParams(max_tokens=12, temperature=0, logprobs=3)


@pytest.fixture(scope="module")
def built():
    ok, why_not = cpu_decode_layers.available()
    if not ok:
        pytest.skip(why_not)


@pytest.fixture(scope="module")
def eager(llm):
    return LLM(model=llm.engine.model_path, device="cpu", enforce_eager=True)


def test_the_same_tokens_and_logprobs_as_the_python_layers(built, llm, eager):
    layers = llm.engine.runner.executor
    assert isinstance(layers, cpu_decode_layers.CpuDecodeLayers)
    assert not isinstance(eager.engine.runner.executor, cpu_decode_layers.CpuDecodeLayers)
    from labsupport.kernels import cpu_products
    thin = cpu_products.thin_rows()  # the rows the C++ layers take: 3 with AVX-512, 2 with AVX2
    for batch in (1, 2, 3, 5):
        before = layers.num_steps
        fast = llm.generate(PROMPTS[:batch], PARAMS, use_tqdm=False)
        slow = eager.generate(PROMPTS[:batch], PARAMS, use_tqdm=False)
        ran = layers.num_steps - before
        assert ran >= 11 if batch <= thin else ran == 0  # every decode step, or none: more rows go to Python
        for a, b in zip(fast, slow):
            assert a.token_ids == b.token_ids
            assert a.logprobs == b.logprobs  # the same kernels in the same order: bit for bit
    assert llm.engine.kv.allocator.num_free == llm.engine.kv.num_blocks  # every block back


def test_an_exercises_attention_keeps_the_python_layers(built, llm, eager):
    """A plugged ``decode_attention`` must run: the C++ layer would read the pool without it."""
    layers, calls = llm.engine.runner.executor, []

    def attendees(q, k_pool, v_pool, rows, block_size):
        calls.append(q.shape[0])
        return paged_decode_attention(q, k_pool, v_pool, rows, block_size)

    before = layers.num_steps
    with llm.engine.plugged(decode_attention=attendees):
        out = llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0]
    assert layers.num_steps == before and len(calls) == 11 * llm.engine.model.config.num_layers
    assert out.token_ids == eager.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0].token_ids


def test_a_replaced_weight_is_read_and_quantized_layers_keep_python(built, llm):
    """The C++ layer keeps each layer's weights between steps; a weight or a module replaced since (here a new
    ``down_proj`` weight, then ``bench quant``'s int8 modules put in a live engine) must be seen at once."""
    import torch
    from labsupport.models.quantize import quantize_model
    own = LLM(model=llm.engine.model_path, device="cpu", num_blocks=64)
    runner, layers = own.engine.runner, own.engine.runner.executor
    own.generate(PROMPTS[:1], PARAMS, use_tqdm=False)  # its weights are read and kept
    down = own.engine.model.model.layers[3].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight.detach() * 1.5, requires_grad=False)
    before = layers.num_steps
    fast = own.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0]
    assert layers.num_steps > before
    runner.executor = EagerStep(runner.model, runner.backend)  # the Python layers, on the same pools
    slow = own.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0]
    runner.executor = layers
    assert fast.token_ids == slow.token_ids and fast.logprobs == slow.logprobs
    quantize_model(own.engine.model, "int8")
    before = layers.num_steps
    out = own.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0]
    assert len(out.token_ids) == 12 and layers.num_steps == before
    quantized = LLM(model=llm.engine.model_path, device="cpu", quantization="int8", num_blocks=64)
    out = quantized.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0]
    assert len(out.token_ids) == 12 and quantized.engine.runner.executor.num_steps == 0


def test_a_weight_and_a_module_replaced_after_the_first_step_are_used(built, llm):
    """The kept weights are checked against where they are held, in this model only: replacing a weight the C++
    layer reads and a whole ``o_proj`` module after a first run gives the Python layers' tokens and logprobs on
    the new weights (which change the answer), still through the C++ layers; with nothing replaced, nothing is
    read again. No hook is left with PyTorch for the whole process."""
    import torch
    from labsupport.models.llama import Linear
    own = LLM(model=llm.engine.model_path, device="cpu", num_blocks=64)
    runner, layers = own.engine.runner, own.engine.runner.executor
    first = own.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0]
    held = layers._held
    assert own.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0].token_ids == first.token_ids
    assert layers._held is held  # nothing replaced: the kept weights served the second run as they were
    blocks = own.engine.model.model.layers
    down = blocks[2].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight.detach() * 2.0, requires_grad=False)
    old = blocks[5].self_attn.o_proj
    new = Linear(old.in_features, old.out_features, bias=False)
    new.weight = torch.nn.Parameter(old.weight.detach().flip(0).contiguous(), requires_grad=False)
    new.kernels = old.kernels  # the model's kernel set, as ``use_kernels`` gave the module it replaces
    blocks[5].self_attn.o_proj = new
    before = layers.num_steps
    fast = own.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0]
    assert layers.num_steps - before >= 11 and layers._held is not held  # read again, and run in C++
    runner.executor = EagerStep(runner.model, runner.backend)  # the Python layers, on the same pools
    slow = own.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0]
    runner.executor = layers
    assert fast.token_ids == slow.token_ids and fast.logprobs == slow.logprobs
    assert fast.token_ids != first.token_ids  # the new weights are what answered
    assert not torch.nn.modules.module._global_parameter_registration_hooks
    assert not torch.nn.modules.module._global_module_registration_hooks
