"""``python -m labsupport chat``: the same greedy answer in-process and from a loopback server."""
import argparse

import pytest

from labsupport.__main__ import main
from labsupport.chat_cli import LocalChat, add_arguments, chat_hint, repl
from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer

QUICK = ["-q", "Name a fruit that is yellow.", "--temperature", "0", "--max-tokens", "12"]


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm)) as srv:
        yield srv


def test_quick_answers_equal_in_process_and_over_http(server, capsys):
    assert main(["chat", *QUICK, "--device", "cpu"]) == 0
    local = capsys.readouterr().out
    assert main(["chat", "--url", server.url + "/v1", *QUICK]) == 0  # model: the first of /v1/models
    remote = capsys.readouterr().out
    assert local.strip() and local == remote


def test_quick_with_a_system_prompt_over_http(server, llm, capsys):
    assert main(["chat", "--url", server.url + "/v1", "--model-name", llm.model_name, *QUICK,
                 "--system", "Answer in French."]) == 0
    assert capsys.readouterr().out.strip()


def test_repl_keeps_the_history_and_streams(llm, capsys):
    seen = []

    class Spy(LocalChat):
        def stream(self, messages, *a):
            seen.append([m["role"] for m in messages])
            yield from super().stream(messages, *a)

    args = argparse.ArgumentParser()
    add_arguments(args)
    args = args.parse_args(["--system", "Be brief.", "--temperature", "0", "--max-tokens", "4"])
    lines = iter(["Hello.", "", "And again?", "exit"])
    repl(Spy(llm), args, read=lambda prompt: next(lines))
    assert seen == [["system", "user"], ["system", "user", "assistant", "user"]]
    assert capsys.readouterr().out.count("\n") >= 3


def test_generate_hints_at_chat_for_a_raw_prompt_to_an_instruct_model(llm, capsys):
    assert main(["generate", "Name a fruit.", "--max-tokens", "2", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "hint:" not in out and err.count("hint:") == 1 and "chat" in err
    assert main(["generate", "Name a fruit.", "--chat", "--max-tokens", "2", "--device", "cpu"]) == 0
    assert "hint:" not in capsys.readouterr().err
    assert "chat" in chat_hint(llm, "Name a fruit.")
    assert chat_hint(llm, [{"role": "user", "content": "Name a fruit."}]) is None
    assert chat_hint(llm, "<|im_start|>user\nhi<|im_end|>\n") is None  # templated by hand


def test_an_unreachable_server_is_one_line(capsys):
    assert main(["chat", "--url", "http://127.0.0.1:1/v1", "--model-name", "x", *QUICK]) == 2
    assert capsys.readouterr().err.startswith("error: APIConnectionError")
