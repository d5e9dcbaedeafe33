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
