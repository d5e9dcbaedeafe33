"""The package's shape: no two modules import each other, the C++ lives in ``kernels/csrc``, not in strings, and
the fast paths live in ``kernels/``, apart from the model and the engine attendees read.

Imports are read from the source (``ast``), every one of them: at the top of a file, inside a function, under
``TYPE_CHECKING``. A module that imports another which imports it back reads as two halves of one idea, and
whichever is imported first sees the other half-built; the shared piece belongs in the lower of the two.
"""
import ast
import dataclasses
import re
from pathlib import Path

import labsupport
from labsupport.engine.attention import AttentionBatch

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
    assert "labsupport.kernels.triton_attention" in imported_modules("labsupport.kernels.select")  # in a function
    assert "labsupport.kernels.select" in imported_modules("labsupport.engine.paged_attention")
    assert "labsupport.kernels.jit" in imported_modules("labsupport.kernels.cpu_ops")  # from . import jit
    assert "labsupport.engine.scheduler" in imported_modules("labsupport.engine.engine")


def test_no_python_file_holds_a_cpp_source():
    """C++ is compiled from ``kernels/csrc`` (``kernels/jit.py``); a kernel kept in a Python string is not seen by
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


# Which package may not import which: the engine and the PD mechanism run inside a server and know nothing of
# how the course measures them; the load generators know no chapter's harness; the offline ``LLM`` and the
# frontend are used without a server. (``bench/cli.py`` is the command line of every measurement, chapters'
# harnesses included: the one ``bench`` module that names ``experiments``.)
LAYER_RULES = {
    "labsupport.engine": ("labsupport.bench", "labsupport.experiments"),
    "labsupport.pd": ("labsupport.bench", "labsupport.experiments"),
    "labsupport.bench": ("labsupport.side_by_side", "labsupport.experiments"),
    "labsupport.frontend": ("labsupport.serve",),
    "labsupport.llm": ("labsupport.serve",),
    "labsupport.result_cache": ("labsupport.serve",),
    # plots draw the data they are given: a saved run, a summary (``percentiles.tail``, ``machine.describe_machine``
    # are below both), never a benchmark's own code
    "labsupport.viz": ("labsupport.bench", "labsupport.experiments"),
}
LAYER_EXCEPTIONS = {("labsupport.bench.cli", "labsupport.experiments")}
SHARED_BASENAMES = {"__init__", "cli"}  # a package's own command line may be called so in each package


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_lower_layers_do_not_import_higher_ones():
    leaks = sorted(f"{name} -> {target}" for name in MODULES for package, forbidden in LAYER_RULES.items()
                   if inside(name, package) for target in imported_modules(name)
                   for above in forbidden if inside(target, above) and (name, above) not in LAYER_EXCEPTIONS)
    assert not leaks, f"imports against the layers: {leaks}"


def test_the_layer_rule_sees_a_leak():
    """The rule above on a leak that existed: a chapter's harness in ``pd/`` importing ``bench/``."""
    rule = LAYER_RULES["labsupport.pd"]
    assert any(inside("labsupport.bench.serving.serve_bench", above) for above in rule)
    assert not inside("labsupport.benchmarks", "labsupport.bench")  # a prefix of a name is not the package
    assert any(inside("labsupport.bench.summary", above) for above in LAYER_RULES["labsupport.viz"])  # viz's old one


def test_no_two_modules_share_a_basename():
    """``viz/course_table.py`` beside ``bench/course_table.py`` made a reader (and a traceback) guess which one
    was meant: a module is named for what it holds, once in the package."""
    by_name: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        if path.stem not in SHARED_BASENAMES:
            by_name.setdefault(path.stem, []).append(name)
    shared = {stem: names for stem, names in by_name.items() if len(names) > 1}
    assert not shared, f"modules with the same file name: {shared}"


# A docstring says why a piece is as it is; how fast it was on one machine one day belongs in benchmarks/README.md,
# where it keeps its date and machine and is not mistaken for a property of the code.
MEASUREMENT = re.compile(r"\d+(\.\d+)?\s*(tok/s|tokens/s|ms\b|µs|us\b|GB/s|MB/s)|\b20\d\d-\d\d-\d\d\b"
                         r"|\d(\.\d+)?\s*[x×]\s+(faster|slower)|\bmeasured on\b(?!:)|\bcommit [0-9a-f]{7,40}\b")
FIGURES_ALLOWED = {  # module -> why its docstring's figures are not measurements
    "labsupport.claims": "it documents the notation of the figures it checks (``1,460 ms``, ``67.8/82.5 tok/s``)",
    "labsupport.serve.async_engine": "a step's range (10-100 ms) is the why: a blocking call, so a thread",
    "labsupport.serve.loop_lag": "the probe's own setting: a task asks to sleep 50 ms",
}


def measurements_in_docstrings(source: str) -> list[str]:
    """The lines of a module's docstring and its classes' that report a measured figure."""
    tree = ast.parse(source)
    docs = [ast.get_docstring(node) or "" for node in ast.walk(tree) if isinstance(node, (ast.Module, ast.ClassDef))]
    return [line.strip() for doc in docs for line in doc.splitlines() if MEASUREMENT.search(line)]


def test_no_module_or_class_docstring_reports_a_measurement():
    found = {name: lines for name, path in MODULES.items() if name not in FIGURES_ALLOWED
             for lines in [measurements_in_docstrings(path.read_text())] if lines}
    assert not found, f"measurements in docstrings (move them to benchmarks/README.md): {found}"
    assert all(measurements_in_docstrings(MODULES[name].read_text()) for name in FIGURES_ALLOWED)  # none stale


def test_the_measurement_finder_sees_what_stood_in_docstrings_and_keeps_design_facts():
    """Lines that were in the package's docstrings once, and design facts that must pass."""
    measured = ["concurrent load on this machine: 15 against 9 tokens/s for 4 users",
                "took 5-6 ms of a 21 ms batch-1 step", "reads the weights at ~33 GB/s", "1.7x faster than the default BLAS",
                "It describes the code as of 2026-12-03", "Defaults measured on SmolLM2-135M-Instruct"]
    facts = ["vLLM uses 16-token blocks", "the target is 70 %", "For each method one engine is measured on:",
             "the stacked gate/up product alone is [6400, 3072] floats", "groups of 32 inputs"]
    for line in measured:
        assert measurements_in_docstrings(f'"""{line}"""'), line
    for line in facts:
        assert not measurements_in_docstrings(f'class A:\n    """{line}"""'), line


def test_the_test_tiers_name_only_files_that_exist():
    """conftest.py orders a run by tier from two lists of file names: a renamed file would silently fall to tier 1."""
    import conftest
    here = {p.name for p in Path(__file__).parent.glob("test_*.py")}
    assert conftest.MODEL_FREE <= here and conftest.SERVERS <= here, (conftest.MODEL_FREE | conftest.SERVERS) - here
    assert not conftest.MODEL_FREE & conftest.SERVERS


MODEL = ROOT / "models" / "llama.py"
# what asks which device a tensor is on, or reaches a device's kernels past the kernel set
DEVICE_BRANCH = re.compile(r"\bis_cuda\b|\.device\.type\b|_gpu_kernels|\bcpu_ops\.|\bcpu_products\.|\btriton_ops\.")
# the functions a kernel set is made of: only kernels/ calls them (select.py chooses them for the model and backend)
KERNEL_FUNCTIONS = {"cpu_rope_qk", "cpu_rms_norm", "cpu_silu_mul", "thin_product", "panel_product", "product",
                    "triton_rope_qk", "triton_silu_mul", "cpu_decode_attention", "cpu_prefill_attention",
                    "triton_decode_attention"}
KERNEL_MODULES = {"cpu_ops", "cpu_products", "products", "triton_ops", "cpu_attention", "triton_attention"}


def test_the_model_reads_in_a_sitting_with_at_most_two_device_branches():
    """``models/llama.py`` as gpt-fast's model: plain PyTorch, short, its fast paths behind one ``Kernels`` seam."""
    source = MODEL.read_text()
    assert len(source.splitlines()) <= 260
    branches = DEVICE_BRANCH.findall(source)
    assert len(branches) <= 2, f"device branches in llama.py: {branches}"
    assert not {m for m in imported_modules("labsupport.models.llama") if m.startswith("labsupport.kernels")}


def test_no_fast_path_module_is_left_in_the_engine_or_the_model():
    """Triton, CUDA graphs, compiled extensions and the C library's allocator are ``kernels/``' business."""
    found = []
    for name, path in MODULES.items():
        if name.startswith(("labsupport.engine.", "labsupport.models.")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] + ([node.module] if getattr(node, "module", None) else [])
                    found += [f"{name}: imports {n}" for n in names if n.split(".")[0] in ("triton", "ctypes")]
                elif isinstance(node, ast.Attribute) and node.attr in ("CUDAGraph", "load_inline", "compile_extension"):
                    found.append(f"{name}: {node.attr}")
    assert not found, found
    moved = {"products", "fused_kernels", "triton_attention", "cuda_graphs", "cpu_decode_layers", "cpu_memory"}
    assert not {p.stem for p in (ROOT / "engine").glob("*.py")} & moved
    assert not {p.stem for p in (ROOT / "models").glob("*.py")} & moved


def test_only_select_decides_the_kernel_set():
    """Outside ``kernels/`` (and ``bench/``, which measures the kernels one by one) no module calls a kernel
    function or imports one by name: the model and the attention backend get theirs from ``kernels/select.py``."""
    found = []
    for name, path in MODULES.items():
        if name.startswith(("labsupport.kernels", "labsupport.bench")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in KERNEL_FUNCTIONS and isinstance(node.value, ast.Name)
                    and node.value.id in KERNEL_MODULES):
                found.append(f"{name}: {node.value.id}.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and any(a.name in KERNEL_FUNCTIONS for a in node.names):
                found.append(f"{name}: from {node.module} import {[a.name for a in node.names]}")
    assert not found, found


def test_the_engine_imports_no_layer_built_on_it():
    """``engine/`` is what ``pd/``, ``serve/`` and ``bench/`` are built on: an import the other way (the connector
    interface once lived in ``pd/``) makes the teaching engine depend on a transport, a server or a benchmark."""
    above = ("labsupport.pd", "labsupport.serve", "labsupport.bench")
    leaks = sorted(f"{name} -> {target}" for name in MODULES if name.startswith("labsupport.engine")
                   for target in imported_modules(name) if target.startswith(above))
    assert not leaks, f"engine modules importing the layers above them: {leaks}"


METADATA_KEYS = {"slot_mapping", "decode", "prefill", "prefill_seqs", "mixed"}  # what the string-keyed dict held


def untyped_attention_metadata(source: str) -> list[str]:
    """Where ``source`` passes attention metadata through a string-keyed dict, the way ``batch.extra`` once did:
    an attribute named ``extra`` (``batch.extra["decode"]``, ``batch.extra = {...}``), an index by
    ``"slot_mapping"`` or ``"prefill_seqs"``, or a dict literal keyed by ``"slot_mapping"`` and another of the
    metadata's names. (A plug point named ``slot_mapping`` or a timeline's ``{"prefill": ..., "decode": ...}`` is
    not metadata and is not found.)"""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "extra":
            found.append(f"{node.lineno}: .extra")
        elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
              and node.slice.value in ("slot_mapping", "prefill_seqs")):
            found.append(f"{node.lineno}: [{node.slice.value!r}]")
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if "slot_mapping" in keys and keys & (METADATA_KEYS - {"slot_mapping"}):
                found.append(f"{node.lineno}: {{{', '.join(map(repr, sorted(keys)))}}}")
    return found


def test_attention_metadata_is_typed_not_a_string_keyed_dict():
    """``PagedAttention.prepare`` hands every layer a ``PagedAttentionMetadata`` (``engine/attention_metadata.py``),
    read by attribute: a field a reader can follow to where it is described, and a misspelling that fails at
    once. A dict of strings beside it (``batch.extra``) would be a second, untyped way to say the same."""
    found = [f"{path.relative_to(ROOT)}:{where}" for path in MODULES.values()
             for where in untyped_attention_metadata(path.read_text())]
    assert not found, f"attention metadata in a string-keyed dict: {found}"
    carried = {f.name: f.type for f in dataclasses.fields(AttentionBatch)}
    assert "extra" not in carried and carried["attn_metadata"] == "PagedAttentionMetadata | None"


def test_the_metadata_finder_sees_the_dict_it_replaced():
    """The finder above, on the code it replaced (``paged_attention.py``, ``cuda_graphs.py``), and on dicts that
    only share a name with the metadata."""
    old = """
extra = {"slot_mapping": slots, "decode": None, "prefill": [], "prefill_seqs": None, "mixed": None}
batch.extra = extra
rows = x["prefill_seqs"]
k_pool.index_copy_(1, meta["slot_mapping"], k)
"""
    assert [w.split(":")[0] for w in untyped_attention_metadata(old)] == ["2", "3", "4", "5"]
    unrelated = """
PLUG_POINTS = {"slot_mapping": PlugPoint("slot_mapping", "ch. 02"), "decode_attention": None}
step = {"start": 0.0, "prefill": {"r1": 69}, "decode": []}
batch.attn_metadata.slot_mapping
"""
    assert untyped_attention_metadata(unrelated) == []


def test_no_class_inherits_a_replaced_mixin():
    """Plug points are declared by each component (``PLUG_POINTS``) and gathered by a ``PlugRegistry`` the engine
    holds; the lifecycle is a component the scheduler owns (``scheduler.lifecycle``), sharing ``RequestQueues``.
    A mixin that reads its host's attributes is what both replaced."""
    mixins = {"PlugPoints", "RequestLifecycle"}
    found = sorted(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}" for path in MODULES.values()
                   for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
                   for base in node.bases if isinstance(base, ast.Name) and base.id in mixins)
    assert not found, f"classes inheriting a mixin: {found}"


# ---------------------------------------------------------------------- no class reads its host's attributes

BASES_WITHOUT_ATTRIBUTES = {"object", "ABC", "abc.ABC"}


def _methods(cls: ast.ClassDef):
    """(method, the name its first parameter gives the instance or class) for each method that has one."""
    for fn in cls.body:
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.args.args and not any(
                isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
            yield fn, fn.args.args[0].arg


def attributes_set_by(cls: ast.ClassDef) -> set[str]:
    """What the class itself gives its instances: methods, class attributes (dataclass fields, properties), and
    every ``self.x = ...`` (or ``del``, or ``setattr(self, "x", ...)``) in its methods."""
    names = {node.name for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for node in cls.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    for fn, me in _methods(cls):
        for n in ast.walk(fn):
            if (isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del))
                    and isinstance(n.value, ast.Name) and n.value.id == me):
                names.add(n.attr)
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr"
                  and len(n.args) >= 2 and isinstance(n.args[0], ast.Name) and n.args[0].id == me
                  and isinstance(n.args[1], ast.Constant)):
                names.add(n.args[1].value)
    return names


def attributes_read_but_never_set(trees: dict[str, ast.Module]) -> list[str]:
    """``file:line Class.attr`` for every ``self.attr`` a method reads that neither the class nor its bases in
    ``trees`` set: an attribute it expects the class it is mixed into (or a subclass) to have. A class with a
    base from outside (``nn.Module``, ``Exception``, ...) or a ``__getattr__`` is not judged: its attributes
    cannot be read from this source."""
    classes: dict[str, list[ast.ClassDef]] = {}
    where: dict[int, str] = {}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)
                where[id(node)] = name

    def known(cls: ast.ClassDef, seen: frozenset = frozenset()) -> set[str] | None:
        names = attributes_set_by(cls)
        for base in cls.bases:
            base_name = ast.unparse(base.value if isinstance(base, ast.Subscript) else base)
            if base_name in BASES_WITHOUT_ATTRIBUTES:
                continue
            if len(classes.get(base_name, [])) != 1 or base_name in seen:
                return None  # from outside, or ambiguous
            inherited = known(classes[base_name][0], seen | {cls.name})
            if inherited is None:
                return None
            names |= inherited
        return names

    found = []
    for defs in classes.values():
        for cls in defs:
            names = known(cls)
            if names is None or "__getattr__" in names:
                continue
            for fn, me in _methods(cls):
                found += [f"{where[id(cls)]}:{n.lineno} {cls.name}.{n.attr}" for n in ast.walk(fn)
                          if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and isinstance(n.value, ast.Name)
                          and n.value.id == me and n.attr not in names and not n.attr.startswith("__")]
    return sorted(found)


def test_no_class_reads_attributes_it_never_sets():
    """Every attribute a class reads on ``self`` is set by the class or a base: its dependencies are in its own
    ``__init__`` (``RequestLifecycle(queues, kv, ...)``), not attributes of whatever class it is mixed into."""
    trees = {path.relative_to(ROOT).as_posix(): ast.parse(path.read_text()) for path in MODULES.values()}
    found = attributes_read_but_never_set(trees)
    assert not found, f"attributes read on self but set nowhere in the class or its bases (a mixin?): {found}"


def test_the_attribute_finder_sees_a_mixin_and_not_a_component():
    """The finder above on known code: a mixin reading its host's ``running`` is found (its host setting it does
    not help); the same logic as a component handed ``running`` in ``__init__`` is not, nor a property, a class
    attribute, an inherited attribute, ``setattr``, or a class with a base from outside."""
    source = """
class Mixin:
    def finish(self, req):
        self.running.remove(req)

class Host(Mixin):
    def __init__(self):
        self.running = []

class Component:
    def __init__(self, running):
        self.running = running
    def finish(self, req):
        self.running.remove(req)
        return self.size, self.depth

    @property
    def size(self):
        return len(self.running)

    depth: int = 0

class Child(Component):
    def __init__(self):
        super().__init__([])
        setattr(self, "label", "x")
    def first(self):
        return self.running[0], self.label

class Layer(nn.Module):
    def forward(self, x):
        return self.weight @ x
"""
    found = attributes_read_but_never_set({"example.py": ast.parse(source)})
    assert found == ["example.py:4 Mixin.running"], found


def test_plug_code_writes_no_instance_dict_directly():
    """Restoring a configuration with ``__dict__.update`` skips ``EngineConfig``'s checks; the options and plug
    points are restored through ``dataclasses.replace`` and the owners' own setters."""
    plug_code = [MODULES["labsupport.engine.plug_points"]]
    offenders = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in plug_code
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Attribute) and node.attr == "__dict__"]
    assert not offenders, f"__dict__ written in plug code: {offenders}"


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
    ``req.remote_kv``, ...), so a reader sees what a request is without every chapter's details. (``priority``
    joined with the priority policy; the prompt tokens the cache supplied went to ``req.metrics`` to make room.)"""
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
