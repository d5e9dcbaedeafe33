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


def test_the_engine_imports_no_layer_built_on_it():
    """``engine/`` is what ``pd/``, ``serve/`` and ``bench/`` are built on: an import the other way (the connector
    interface once lived in ``pd/``) makes the teaching engine depend on a transport, a server or a benchmark."""
    above = ("labsupport.pd", "labsupport.serve", "labsupport.bench")
    leaks = sorted(f"{name} -> {target}" for name in MODULES if name.startswith("labsupport.engine")
                   for target in imported_modules(name) if target.startswith(above))
    assert not leaks, f"engine modules importing the layers above them: {leaks}"


def test_no_class_inherits_the_plug_points_mixin():
    """Plug points are declared by each component (``PLUG_POINTS``) and gathered by a ``PlugRegistry`` the engine
    holds; a mixin that reads its host's attributes is what that replaced."""
    mixins = {"PlugPoints"}
    found = sorted(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}" for path in MODULES.values()
                   for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
                   for base in node.bases if isinstance(base, ast.Name) and base.id in mixins)
    assert not found, f"classes inheriting a mixin: {found}"


def test_plug_code_writes_no_instance_dict_directly():
    """Restoring a configuration with ``__dict__.update`` skips ``EngineConfig``'s checks; the options and plug
    points are restored through ``dataclasses.replace`` and the owners' own setters."""
    plug_code = [MODULES["labsupport.engine.plug_points"]]
    offenders = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in plug_code
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Attribute) and node.attr == "__dict__"]
    assert not offenders, f"__dict__ written in plug code: {offenders}"
