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


def test_the_test_tiers_name_only_files_that_exist():
    """conftest.py orders a run by tier from two lists of file names: a renamed file would silently fall to tier 1."""
    import conftest
    here = {p.name for p in Path(__file__).parent.glob("test_*.py")}
    assert conftest.MODEL_FREE <= here and conftest.SERVERS <= here, (conftest.MODEL_FREE | conftest.SERVERS) - here
    assert not conftest.MODEL_FREE & conftest.SERVERS
