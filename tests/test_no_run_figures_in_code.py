"""No run figures in the code's prose: comments and docstrings say why; what a run measured goes to
``benchmarks/README.md`` ("Figures once quoted in the code's comments").

A run figure is a number with a unit of time, memory, speed or ratio ("~80 s", "425 MB", "16 %", "2x") written
next to words that tie it to one run or one machine: "here", "on this machine", "on 2 cores", "2-core",
"this VM", "measured", "took", "once held", "seen", "and counting". A constant and its unit ("sleeps 10 ms
between polls"), a model's arithmetic ("0.7 MB a block") or a target ("Target: < 0.5 s") names no run and
passes. The scan reads every ``labsupport/**/*.py`` (comments, docstrings and other bare strings) and the C++
comments of ``labsupport/kernels/csrc``.
"""
import ast
import io
import re
import tokenize
from pathlib import Path

import labsupport

ROOT = Path(labsupport.__file__).parent

_NUM = r"~?\d[\d,]*(?:\.\d+)?"
# a number (or a range of them) and a unit: "~80 s", "0.2-0.4 s", "425 MB", "16 %", "1.06x-1.17x", "100+ GB/s"
FIGURE = re.compile(
    rf"(?<![\w.]){_NUM}(?:\s*(?:-|–|to)\s*{_NUM})?\+?"
    r"(?:x|×|\s?(?:%|ms|us|µs|μs|ns|s|secs?|seconds?|min|minutes?|hours?|[KMGT]i?B(?:/s)?|bytes"
    r"|tok(?:ens)?/s|req/s|[GT]FLOP/s))(?![\w/])")
# words that say the figure was seen on one run or one machine
RUN = re.compile(
    r"\bhere\b|\bon this machine\b|\bthis (?:VM|CPU|box)\b|\bVMs?\b|\b(?:2|two)[- ](?:CPU[- ])?cores?\b"
    r"|\bmeasured\b|\btook\b|\bonce (?:took|held|ran)\b|\bseen\b|\band counting\b|\bon one H[12]00\b")
# clauses: a figure and its run word must share one (sentence, semicolon, colon or parenthesis)
CLAUSE = re.compile(r"[.;:!?](?=\s)|[()]")
NEAR = 70  # characters at most between a figure and its run word

# (file relative to labsupport/, words of the clause): run-looking figures that are not run figures
ALLOWED = {
    ("pacing.py", "the course holds it to 3 minutes on a 2-core CPU"),  # a target every chapter is held to
    # arithmetic: 16 tokens x 64 floats x 4 bytes, the block of the default model and block size
    ("kernels/csrc/paged_decode.cpp", "A block is 4 KB here, so the hardware prefetcher stops at its end"),
}


def run_figures(text: str) -> list[str]:
    """The clauses of ``text`` that hold a run figure, each as written (whitespace folded)."""
    found = []
    for clause in CLAUSE.split(" ".join(text.split())):
        figures = [m.span() for m in FIGURE.finditer(clause)]
        runs = [m.span() for m in RUN.finditer(clause)]
        if any(max(f0, r0) - min(f1, r1) <= NEAR for f0, f1 in figures for r0, r1 in runs):
            found.append(clause.strip())
    return found


def python_prose(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment (a run of whole-line comments as one) and bare string of ``source``."""
    out, block, last = [], [], None
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        row, col = tok.start
        text = tok.string.lstrip("#").strip()
        whole_line = not lines[row - 1][:col].strip()
        if whole_line and block and last == row - 1:
            block[1] += " " + text
        else:
            if block:
                out.append(tuple(block))
            block = [row, text]
        last = row if whole_line else None
    if block:
        out.append(tuple(block))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.append((node.lineno, node.value.value))
    return out


def cpp_prose(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every ``//`` comment (a run of them on consecutive lines as one) and ``/* */`` block."""
    out, block, last = [], [], None
    for row, line in enumerate(source.splitlines(), 1):
        m = re.search(r"//(.*)$", line)
        if not m:
            continue
        if block and last == row - 1:
            block[1] += " " + m.group(1).strip()
        else:
            if block:
                out.append(tuple(block))
            block = [row, m.group(1).strip()]
        last = row
    if block:
        out.append(tuple(block))
    out += [(source[:m.start()].count("\n") + 1, m.group(1)) for m in re.finditer(r"/\*(.*?)\*/", source, re.S)]
    return out


def prose_of(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings of a file the scan reads; [] for any other file."""
    if path.suffix == ".py":
        return python_prose(path.read_text())
    if path.suffix in (".cpp", ".h", ".cu") and "csrc" in path.parts:
        return cpp_prose(path.read_text())
    return []


def scan() -> list[str]:
    problems = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT).as_posix()
        for line, text in prose_of(path):
            for clause in run_figures(text):
                if (rel, clause) not in ALLOWED:
                    problems.append(f"labsupport/{rel}:{line}: {clause}")
    return problems


def test_no_run_figures_in_comments_or_docstrings():
    problems = scan()
    assert not problems, ("run figures belong in benchmarks/README.md, not in the code's prose; say why instead:\n"
                          + "\n".join(problems))


def test_the_allow_list_is_still_needed():
    # an entry whose text is gone (or no longer flagged) is dropped, not kept "just in case"
    flagged = set()
    for rel, _ in ALLOWED:
        for _, text in prose_of(ROOT / rel):
            flagged |= {(rel, c) for c in run_figures(text)}
    assert ALLOWED <= flagged


def test_planted_run_figures_are_flagged():
    source = '''"""A planted module.

Rebuilding every extension takes ~80 s on 2 cores, and a queue of outputs once held 425 MB.
"""
FLAGS = ["-mavx2", "-mfma"]  # 16 % faster than SSE2 here
# on the 2-core CPU a step of 512 prompt tokens
# takes ~0.2-0.4 s, measured on this machine


def start():
    """vLLM spends ~7 s of a 2-core CPU on imports (seen: 45 s and counting)."""
'''
    flagged = [c for _, text in python_prose(source) for c in run_figures(text)]
    assert any("~80 s on 2 cores" in c for c in flagged), flagged
    assert any("once held 425 MB" in c for c in flagged), flagged
    assert any("16 % faster than SSE2 here" in c for c in flagged), flagged
    assert any("~0.2-0.4 s, measured" in c for c in flagged), flagged
    assert any("~7 s of a 2-core CPU" in c for c in flagged), flagged
    assert any("45 s and counting" in c for c in flagged), flagged
    cpp = "// ask for the next row (27 % faster per layer here, measured cold)\nint x;\n"
    assert [c for _, text in cpp_prose(cpp) for c in run_figures(text)], "a C++ comment's run figure"


def test_planted_legitimate_prose_passes():
    source = '''"""Polls the server.

Target: the client gets an error within 5 s. Each block of the default model is 0.7 MB, so 512 blocks
hold ~0.4 GB. ``bandwidth_gbps`` in GB/s (1e9 bytes a second). The ratio is printed as "1.31x".
"""
POLL_S = 0.01  # sleeps 10 ms between polls
GRACE_S = 10.0  # how long SIGTERM may take before SIGKILL (Jupyter waits ~5 s for a kernel)
CHUNK = 256  # the chapter's CHUNK_TOKENS: 256 x GPU_SCALE
'''
    assert [c for _, text in python_prose(source) for c in run_figures(text)] == []
