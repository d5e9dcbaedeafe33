"""``python -m labsupport chat``: talk to the model, as ``vllm chat`` does.

    python -m labsupport chat                                   # in-process engine, embedded model
    python -m labsupport chat --url http://127.0.0.1:8000/v1    # any OpenAI-compatible server
    python -m labsupport chat -q "Name a yellow fruit." --temperature 0

An instruct model answers well only inside its chat template; ``generate`` sends the prompt raw.
Here every turn goes in as a message list: the engine's frontend (or the server's) applies the
template, and the conversation so far goes with each new question, since the model remembers
nothing between requests. The answer is printed as it is generated: in-process by stepping the
engine and printing each new piece of text, remotely from the server's stream.
"""
from __future__ import annotations

import sys
import time


class LocalChat:
    """An in-process ``LLM``: the same frontend path as ``LLM.chat``, one engine step at a time."""

    def __init__(self, llm):
        self.llm, self.model_name = llm, llm.model_name

    def stream(self, messages, max_tokens: int, temperature: float | None = None, seed: int | None = None):
        """Yield the answer's text as it grows; stopping early (Ctrl-C) aborts the request."""
        from .engine.request import SamplingParams
        options = {} if temperature is None else {"temperature": temperature}
        params = SamplingParams(max_tokens=max_tokens, seed=seed, **options)
        prepared = self.llm.frontend.prepare(messages, params, use_result_cache=False)
        req = self.llm.frontend.submit(prepared)
        sent = 0
        try:
            while not req.is_finished:
                self.llm.engine.step()
                text = req.streamable_text()  # holds back what a stop string might still cut
                if len(text) > sent:
                    yield text[sent:]
                    sent = len(text)
            text = self.llm.frontend.complete(prepared, req).text
            if len(text) > sent:
                yield text[sent:]
        finally:
            self.llm.engine.abort(req)  # a no-op once finished; frees the KV blocks if interrupted


class RemoteChat:
    """A server's ``/v1/chat/completions`` through the official ``openai`` client, streamed."""

    def __init__(self, url: str, model_name: str | None = None, api_key: str | None = None):
        import os

        import openai
        self.client = openai.OpenAI(base_url=url, api_key=api_key or os.environ.get("OPENAI_API_KEY", "EMPTY"))
        self.model_name = model_name or self.client.models.list().data[0].id

    def stream(self, messages, max_tokens: int, temperature: float | None = None, seed: int | None = None):
        options = {k: v for k, v in (("temperature", temperature), ("seed", seed)) if v is not None}
        with self.client.chat.completions.create(model=self.model_name, messages=messages, max_tokens=max_tokens,
                                                 stream=True, **options) as chunks:
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    yield chunk.choices[0].delta.content


def reply(backend, messages, args, out=None) -> str:
    """Print the answer as it streams; return it whole. ``--stats`` adds TTFT and speed on stderr."""
    out = out or sys.stdout  # looked up now: a test or a notebook may have replaced it
    start, first, pieces = time.perf_counter(), None, []
    for piece in backend.stream(messages, args.max_tokens, args.temperature, args.seed):
        first = first or time.perf_counter()
        pieces.append(piece)
        print(piece, end="", file=out, flush=True)
    print(file=out, flush=True)
    if args.stats and first is not None:
        total = time.perf_counter() - start
        print(f"TTFT: {(first - start) * 1000:.0f} ms, {total:.2f} s in all", file=sys.stderr)
    return "".join(pieces)


def repl(backend, args, read=input) -> None:
    """Read a message, answer it, keep both in the history. Ctrl-C during an answer stops that answer;
    at the prompt (or Ctrl-D, ``exit``) it ends the chat."""
    history = [{"role": "system", "content": args.system}] if args.system else []
    print(f"Using model: {backend.model_name}. Type a message; Ctrl-D or 'exit' to quit.")
    while True:
        try:
            message = read("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if message.strip() in ("exit", "quit"):
            return
        if not message.strip():
            continue
        history.append({"role": "user", "content": message})
        try:
            answer = reply(backend, history, args)
        except KeyboardInterrupt:
            print("\n[stopped]")
            answer = ""
        history.append({"role": "assistant", "content": answer})


def add_arguments(p) -> None:
    p.add_argument("--url", default=None,
                   help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 (default: an in-process engine)")
    p.add_argument("--model-name", default=None, help="with --url: the served model (default: the first listed)")
    p.add_argument("--api-key", default=None, help="with --url (default: $OPENAI_API_KEY or EMPTY)")
    p.add_argument("--model", default=None,
                   help="in-process: HF folder or hub id (default: embedded SmolLM2-135M-Instruct); with --url: "
                        "the served name, if --model-name is not given")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--system", "--system-prompt", dest="system", default=None, help="a system message first")
    p.add_argument("--max-tokens", type=int, default=256, help="longest answer, in tokens")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: the server's, 1.0)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("-q", "--quick", metavar="MESSAGE", default=None, help="answer this one message and exit")
    p.add_argument("--stats", action="store_true", help="print TTFT and time after each answer (stderr)")


def make_backend(args):
    if args.url:
        return RemoteChat(args.url, args.model_name or args.model, args.api_key)
    from . import LLM
    return LocalChat(LLM(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len))


def main(args, backend=None) -> int:
    """Run ``chat``; ``backend`` lets a caller (a test, a notebook) pass a ready ``LocalChat``/``RemoteChat``."""
    try:
        backend = backend or make_backend(args)
        if args.quick is not None:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            reply(backend, messages + [{"role": "user", "content": args.quick}], args)
        else:
            repl(backend, args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the server is down, refused the request: one line, not a traceback
        if type(exc).__module__.startswith(("openai", "httpx")):
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        raise
    return 0


def chat_hint(llm, prompt) -> str | None:
    """For ``generate``: one line when an instruct model (it has a chat template) got a raw prompt."""
    tok = llm.tokenizer
    if not isinstance(prompt, str) or not getattr(tok, "chat_template", None):
        return None
    if any(s in prompt for s in getattr(tok, "all_special_tokens", [])):
        return None  # the prompt is already templated by hand
    return (f"hint: {llm.model_name} is an instruct model with a chat template, and this prompt went in raw; "
            f"for a conversation use `python -m labsupport chat -q \"...\"` or `generate --chat`")
