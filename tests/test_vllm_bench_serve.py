"""vLLM's own load generator, ``vllm bench serve``, against our server: the proof that the server speaks
the OpenAI streaming protocol the way vLLM's tools read it (chat and text completions, ``ignore_eos``,
``max_completion_tokens``, content as a list of parts, a final usage chunk, ``[DONE]``).

The CLI runs from ``.venv-vllm`` (``make vllm-env``) as a subprocess; the server runs in this process
on a free loopback port. Without that venv the tests skip, saying so."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer

VLLM_VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"
VLLM = VLLM_VENV / "bin" / "vllm"
NUM_PROMPTS, OUTPUT_LEN = 8, 8


def why_skip() -> str | None:
    if not VLLM.exists():
        return f"{VLLM} is missing: `make vllm-env` installs vLLM's CLI there (`make test` does it first)"
    if not (VLLM_VENV / ".installed").exists():  # the `vllm` metadata the CLI reads is written last
        return f"{VLLM_VENV} is not completely installed: run `make vllm-env`"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(why_skip() is not None, reason=str(why_skip()))]


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm, "smol")) as srv:
        yield srv


@pytest.mark.parametrize("backend, endpoint", [("openai-chat", "/v1/chat/completions"),
                                               ("openai", "/v1/completions")])
def test_vllm_bench_serve_completes_every_request(llm, server, tmp_path, backend, endpoint):
    cmd = [str(VLLM), "bench", "serve", "--backend", backend, "--endpoint", endpoint, "--base-url", server.url,
           "--model", "smol", "--tokenizer", str(llm.engine.model_path), "--dataset-name", "random",
           "--random-input-len", "32", "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS),
           "--max-concurrency", "4", "--ignore-eos", "--seed", "0", "--disable-tqdm",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json"]
    # VLLM_TARGET_DEVICE: the `vllm` metadata `make vllm-env` writes says "0.32.0", without the "+cpu" vLLM
    # looks for to pick its CPU platform; unpicked, it loads the AVX-512 kernels and dies on an AVX2-only CPU
    # ("Illegal instruction"). The client starts no engine: its KV space and threads stay small.
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    log = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, log
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, log
    assert result["total_output_tokens"] == OUTPUT_LEN * NUM_PROMPTS, log
    assert result["backend"] == backend and result["model_id"] == "smol"
