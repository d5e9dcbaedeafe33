import os

import pytest
import torch

torch.manual_seed(0)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
    "In machine learning, overfitting means",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
]


@pytest.fixture(scope="session")
def llm():
    from labsupport import LLM
    return LLM(device="cpu")


@pytest.fixture(scope="session")
def hf_model(llm):
    """transformers' own Llama on the same converted weights: the reference we must equal."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=torch.float32).eval()


# ---- the order of a run, and the quick loop ---------------------------------------------------------------
# A run goes from what fails fastest to what costs most: model-free tests first, then tests that run the engine
# in this process, then tests that start a server, a process or vLLM. A mistake in the allocator shows in
# seconds, before the first server starts. Tiers are by file (a module's fixtures are shared by its tests, and
# `make unit`'s xdist `--dist loadfile` keeps a file on one worker): a file not named below is in tier 1.
# Every test of tier 2 is marked `slow` here (each starts something and waits on it), so
# `make unit-quick` (`-m "not slow and not vllm_serve"`) is tiers 0 and 1 without their own slow tests.
MODEL_FREE = {  # tier 0
    "test_block_map_plot.py", "test_chapter_charts.py", "test_engine_core.py", "test_environment.py",
    "test_exercises.py", "test_kv_memory.py", "test_model_arithmetic.py", "test_notebooks.py", "test_soak.py",
    "test_structure.py", "test_claims.py", "test_source_map.py", "test_gpu_check.py", "test_build_lock.py",
    "test_saved_reports.py", "test_measure.py", "test_kv_server_close.py",
}
SERVERS = {  # tier 2
    "test_kv_events.py", "test_production_router.py",
    "test_api_input.py", "test_api_lifecycle.py", "test_api_openai.py", "test_api_priority.py", "test_api_surface.py",
    "test_bench.py",
    "test_capstone.py", "test_chat_cli.py", "test_course_table.py", "test_dashboard.py",
    "test_engine_core_process.py", "test_metrics.py", "test_pd.py", "test_pd_serving.py", "test_pd_timeline.py",
    "test_procs.py", "test_router.py", "test_serve_bench.py", "test_serve_compare.py", "test_serve_limits.py",
    "test_serve_reliability.py", "test_server.py", "test_serving_checks.py", "test_side_by_side_parity.py",
    "test_side_by_side_pd.py", "test_slides.py", "test_vllm_bench_serve.py", "test_widgets_browser.py",
}


def tier(path) -> int:
    """0: model-free, 1: the engine in this process, 2: a server, a process or vLLM (see the lists above)."""
    name = os.path.basename(str(path))
    return 0 if name in MODEL_FREE else 2 if name in SERVERS else 1


def pytest_collection_modifyitems(config, items):
    """Sort the run by tier, keeping each file's own order (a stable sort), and mark tier 2 `slow`."""
    for item in items:
        if tier(item.path) == 2:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: tier(item.path))
