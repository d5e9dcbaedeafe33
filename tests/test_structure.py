"""The package's shape: no two modules import each other, and the C++ lives in ``kernels/csrc``, not in strings.

Imports are read from the source (``ast``), every one of them: at the top of a file, inside a function, under
``TYPE_CHECKING``. A module that imports another which imports it back reads as two halves of one idea, and
whichever is imported first sees the other half-built; the shared piece belongs in the lower of the two.
"""
import ast
import re
from pathlib import Path

import labsupport

ROOT = Path(labsupport.__file__).parent
CPP_IN_A_STRING = re.compile(r"^\s*#include\s*[<\"]|torch::Tensor\s+\w+\(|TORCH_CHECK\(|at::parallel_for\(", re.M)


def module_name(path: Path) -> str:
    parts = ("labsupport",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported_modules(name: str) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file: ``from .x import y`` imports ``x``, or
    ``x.y`` where that is a module; ``from . import y`` imports ``y`` where it is a module, else the package."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source)
    return {m for m in found if m in MODULES and m != name}


def test_no_two_modules_import_each_other():
    imports = {name: imported_modules(name) for name in MODULES}
    circles = sorted({tuple(sorted((a, b))) for a, targets in imports.items() for b in targets if a in imports[b]})
    assert not circles, f"modules that import each other: {circles}"


def test_the_import_reader_sees_function_level_and_relative_imports():
    """The reader above, on files whose imports are known: a function-level one, ``from .. import``, a module
    named in ``from . import``."""
    assert "labsupport.kernels.cpu_attention" in imported_modules("labsupport.engine.paged_attention")
    assert "labsupport.kernels.cpu_ops" in imported_modules("labsupport.models.llama")
    assert "labsupport.kernels.build" in imported_modules("labsupport.kernels.cpu_ops")  # from . import build as ...
    assert "labsupport.engine.scheduler" in imported_modules("labsupport.engine.engine")


def test_no_python_file_holds_a_cpp_source():
    """C++ is compiled from ``kernels/csrc`` (``kernels/build.py``); a kernel kept in a Python string is not seen by
    a C++ editor, compiler warnings or the package's data files."""
    holders = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in MODULES.values()
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and CPP_IN_A_STRING.search(node.value)]
    assert not holders, f"C++ in Python strings: {holders}"


def test_every_cpp_source_is_package_data():
    """A non-editable install copies only the data files pyproject names; the kernels are built from them there."""
    import tomllib
    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["labsupport.kernels"]
    kernels = ROOT / "kernels"
    shipped = {p for pattern in patterns for p in kernels.glob(pattern)}
    assert set((kernels / "csrc").iterdir()) <= shipped
    assert {p.suffix for p in shipped} == {".cpp", ".h"}


# ---------------------------------------------------------------------- who writes a request's state

REQUEST_NAMES = {"req", "request", "child", "r", "seq", "sample", "parent",  # what the package calls a Request
                 "requests", "reqs"}  # ... or a list of them: requests[i].metrics.arrival_time = ...
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "add", "discard", "sort", "reverse"}
STATE_FILES = {"engine/request.py", "engine/lifecycle.py"}  # the request itself, and update_from_output's half
PART_OWNERS = {"kv": {"engine/kv_cache_manager.py"}}  # the block table and its hashes: the KV manager's alone
MOST_WRITES_ELSEWHERE = 4


def request_fields() -> set[str]:
    """The attributes ``Request.__init__`` gives a request (``self.x = ...``), read from the source."""
    tree = ast.parse((ROOT / "engine" / "request.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Request")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    targets = [t for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    return {a.attr for t in targets for a in ast.walk(t)
            if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "self"}


def _chain(node) -> tuple[str, list[str]] | None:
    """``req.kv.block_table[i]`` -> ("req", ["kv", "block_table"]); None for anything not rooted at a name."""
    attrs = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) and attrs else None


def request_writes(path: Path, fields: set[str]) -> list[tuple[int, str]]:
    """(line, ``name.field...``) of every assignment, ``del`` or in-place change (``.append`` ...) of a request's
    state in ``path``: a target rooted at a request's usual name whose first attribute is one of Request's."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        else:
            continue
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                chain = _chain(t)
                if chain and chain[0] in REQUEST_NAMES and chain[1][0] in fields:
                    found.append((node.lineno, ".".join([chain[0], *chain[1]])))
    return found


def test_a_request_has_at_most_18_attributes_of_its_own():
    """Every request has a few fields; a chapter's feature keeps its state in one small part (``req.spec``,
    ``req.remote_kv``, ...), so a reader sees what a request is without every chapter's details."""
    fields = request_fields()
    assert {"request_id", "output_token_ids", "num_computed_tokens", "kv", "spec"} <= fields  # the reader works
    assert len(fields) <= 18, f"Request has {len(fields)} attributes: {sorted(fields)}"


def test_request_state_is_written_in_two_files_and_the_kv_part_by_the_kv_manager():
    """``update_from_output`` and its helpers (``lifecycle.py``) move a request forward; a write anywhere else is
    one a reader must find, so there are at most four, each with a comment saying why it is there. The ``kv``
    part (block table, block hashes) is written by the KV manager alone."""
    fields = request_fields()
    elsewhere, kv_writes = [], []
    for path in MODULES.values():
        name = path.relative_to(ROOT).as_posix()
        lines = path.read_text().splitlines()
        for line, target in request_writes(path, fields):
            part = target.split(".")[1]
            if part in PART_OWNERS:
                if name not in PART_OWNERS[part] | {"engine/request.py"}:
                    kv_writes.append(f"{name}:{line} {target}")
            elif name not in STATE_FILES:
                commented = "#" in lines[line - 1] or lines[line - 2].strip().startswith("#")
                elsewhere.append((f"{name}:{line} {target}", commented))
    assert not kv_writes, f"the kv part written outside the KV manager: {kv_writes}"
    assert len(elsewhere) <= MOST_WRITES_ELSEWHERE, f"request state written outside {STATE_FILES}: {elsewhere}"
    assert all(commented for _, commented in elsewhere), f"writes without a comment saying why: {elsewhere}"


def test_the_write_finder_sees_assignments_deletions_and_in_place_changes():
    fields = request_fields()
    lifecycle = {target for _, target in request_writes(ROOT / "engine" / "lifecycle.py", fields)}
    assert {"req.status", "req.output_token_ids", "req.metrics.token_times", "req.logprobs.output"} <= lifecycle
    kv = {target for _, target in request_writes(ROOT / "engine" / "kv_cache_manager.py", fields)}
    assert {"req.kv.block_table", "child.kv.block_table"} <= kv
