"""docs/architecture.md against the code: a page that says where a request goes must name files that exist, name
every module of the engine's own packages, and say only what the code does where it makes a checkable claim."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "architecture.md").read_text()
PACKAGE = ROOT / "labsupport"
# The packages a request crosses (the page's subject); bench/, viz/, checks/ and experiments/ are named by folder.
CORE = ("engine", "serve", "kernels", "models", "pd", "sim")


def named_paths() -> set[str]:
    """Every ``something.py`` the page names in backticks, with its folder where it gives one."""
    return set(re.findall(r"`([A-Za-z0-9_./-]+\.py)`", DOC)) | set(
        re.findall(r"^\s+((?:[a-z_]+/)+[a-z_0-9]+\.py)\b", DOC, re.MULTILINE))  # the drawn request path


def test_every_file_the_page_names_exists():
    everything = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    missing = []
    for name in sorted(named_paths()):
        if "/" in name:  # a path: relative to labsupport/ (or the repository, for tests/ and the like)
            if not ((PACKAGE / name).exists() or (ROOT / name).exists()):
                missing.append(name)
        elif not any(p.split("/")[-1] == name for p in everything):
            missing.append(name)
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_a_bare_file_name_in_a_folder_bullet_is_in_that_folder():
    """The "folder by folder" list names files by their bare names under a ``* `folder/`:`` bullet."""
    section = DOC.split("## The package, folder by folder", 1)[1]
    wrong = []
    for bullet in re.split(r"\n\* ", section):
        folder = re.match(r"`([a-z_]+)/`", bullet)
        if not folder or folder.group(1) not in CORE:
            continue
        for name in re.findall(r"`([a-z_0-9]+\.py)`", bullet):
            if not (PACKAGE / folder.group(1) / name).exists() and not (PACKAGE / name).exists():
                wrong.append(f"{folder.group(1)}/{name}")
    assert not wrong, f"docs/architecture.md puts these files in folders that do not hold them: {wrong}"


def test_every_module_of_the_engine_packages_is_named():
    names = {n.split("/")[-1] for n in named_paths()}
    globbed = set(re.findall(r"`([a-z_]+)\*\.py`", DOC))  # "metrics*.py" names metrics.py, metrics_parse.py, ...
    unnamed = [p.relative_to(PACKAGE).as_posix() for package in CORE for p in sorted((PACKAGE / package).glob("*.py"))
               if p.name != "__init__.py" and p.name not in names and not any(p.name.startswith(g) for g in globbed)]
    assert not unnamed, f"docs/architecture.md does not name these modules: {unnamed}"


def test_what_the_page_says_request_fork_copies_is_what_it_copies():
    source = (PACKAGE / "engine" / "request.py").read_text()
    fork = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "fork")
    copied = {ast.unparse(t).removeprefix("child.") for n in ast.walk(fork) if isinstance(n, ast.Assign)
              for t in n.targets}
    said = [row.split("|")[1] for row in DOC.splitlines() if row.startswith("|") and "copied by `Request.fork`" in row]
    claimed = {f for cell in said for f in re.findall(r"`([a-z_.]+)`", cell)}
    assert claimed, "the ownership table no longer says what Request.fork copies: update this test"
    assert claimed <= copied, (f"the page says Request.fork copies {sorted(claimed - copied)}; "
                              f"it copies {sorted(copied)}")


def test_the_page_is_not_pinned_to_an_old_commit():
    """A commit and a date at the top go stale silently; this test is what keeps the page current."""
    assert not re.search(r"as of \d{4}-\d\d-\d\d", DOC[:600]) and not re.search(r"\bat [0-9a-f]{7,40}\b", DOC[:600])
