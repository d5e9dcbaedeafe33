"""Build the course slide decks, offline, from the executed notebooks.

    python slides/build.py [--pdf] [--only 00]

Step 1, figures. A code cell in ``notebooks/NN_*.ipynb`` whose tags contain ``slide:<name>``
has its first ``image/png`` output written to ``slides/figures/NN_<name>.png``. The figures on
the slides are therefore the plots the notebook really produced when it was run, never a
redrawn copy that could drift from what students see.

Step 2, decks. Every Marp deck ``slides/NN_*.md`` becomes ``slides/build/NN_*.html`` (and, with
``--pdf`` and a Chromium present, ``slides/build/NN_*.pdf``). Local images are inlined as data
URIs before Marp sees the deck, so one HTML file is the whole deck: it can be mailed, copied to
a USB stick or opened from any folder, and needs no network. The built HTML is then checked to
load nothing from the network (no CDN script, stylesheet or font).

Numbers a slide states come from the notebook too: a line ``<!-- output: NAME -->`` (``<!-- output: NN NAME -->``
for another chapter's notebook) becomes the Markdown output (``display(Markdown(...))``) of the cell tagged
``slide-text:NAME`` (``notebook_text.py``), so a table or a sentence of measured figures on a slide is the one
the notebook printed in its last run, never a hand-copied one that the next run makes false.

Step 3, fit. With a Chromium present, every page is laid out in it and measured (``overflow.mjs``
drives it, ``overflow.js`` measures): content above the slide, past its sides or below the footer
line fails the build, naming the deck and the page, because Marp clips such content silently and
the slide is projected without it.

Two decks from each file (``debrief.py``): slides marked ``<!-- debrief -->`` hold the exercises' answers and
form the deck's last section. The presenting build drops them, so a deck projected before the exercise time
gives nothing away; ``--instructor`` builds the decks with that debrief section into ``<out>/instructor/``.

Any problem (a tagged cell without a PNG or without markdown, a deck pointing at a figure or an
output nobody produced, Marp failing, a page overflowing) is reported with the file it concerns,
and the exit status is non-zero.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from course_map import expand as expand_course_map  # noqa: E402  (slides/course_map.py, beside this file)
from debrief import select as select_slides  # noqa: E402  (slides/debrief.py)
from notebook_text import expand as expand_notebook_text  # noqa: E402  (slides/notebook_text.py)

REPO = HERE.parent
TAG_PREFIX = "slide:"
FIGURE_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
               ".gif": "image/gif", ".webp": "image/webp"}  # the data URIs Marp's parser accepts
MD_IMAGE = re.compile(r"(!\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
HTML_IMAGE = re.compile(r"(<img\b[^>]*?\bsrc=[\"'])([^\"']+)([\"'])", re.IGNORECASE)
# Anything that would make a browser fetch from elsewhere: resource tags, CSS imports and url().
EXTERNAL_LOADS = [
    re.compile(r"<(?:script|link|img|iframe|source|video|audio|embed|object)\b[^>]*?"
               r"\b(?:src|href|data)\s*=\s*[\"']?\s*(?:https?:)?//[^\s\"'>]+", re.IGNORECASE),
    re.compile(r"@import\s+(?:url\()?\s*[\"']?\s*(?:https?:)?//[^\s\"')]+", re.IGNORECASE),
    re.compile(r"url\(\s*[\"']?\s*(?:https?:)?//[^\s\"')]+", re.IGNORECASE),
]


class BuildError(Exception):
    """A problem the author has to fix; the message names the file concerned."""


def chapter_files(directory: Path, suffix: str, only: set[str] | None) -> list[Path]:
    """``NN_*<suffix>`` files of a directory (not its subfolders), in chapter order."""
    files = sorted(p for p in directory.glob(f"[0-9][0-9]_*{suffix}") if p.is_file())
    return [p for p in files if not only or p.name[:2] in only]


def first_png(cell) -> bytes | None:
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        if "image/png" in data:
            png = data["image/png"]
            return base64.b64decode("".join(png) if isinstance(png, list) else png)
    return None


def extract_figures(notebooks_dir: Path, figures_dir: Path, only: set[str] | None) -> list[Path]:
    """Step 1: write every ``slide:<name>`` cell's PNG to ``figures/NN_<name>.png``.

    Old figures of the chapters being rebuilt are removed first, so a tag deleted from a
    notebook cannot leave a stale figure behind that a deck would silently keep using.
    """
    if not notebooks_dir.is_dir():
        raise BuildError(f"notebooks folder not found: {notebooks_dir}")
    figures_dir.mkdir(parents=True, exist_ok=True)
    written, errors = [], []
    for nb_path in chapter_files(notebooks_dir, ".ipynb", only):
        chapter = nb_path.name[:2]
        for stale in figures_dir.glob(f"{chapter}_*.png"):
            stale.unlink()
        try:
            notebook = nbformat.read(nb_path, as_version=4)
        except Exception as error:  # a half-saved or merge-conflicted notebook
            errors.append(f"{nb_path}: cannot be read as a notebook: {error}")
            continue
        for cell in notebook.cells:
            for tag in cell.get("metadata", {}).get("tags", []):
                if not tag.startswith(TAG_PREFIX):
                    continue
                name = tag[len(TAG_PREFIX):]
                target = figures_dir / f"{chapter}_{name}.png"
                png = first_png(cell)
                if not FIGURE_NAME.match(name):
                    errors.append(f"{nb_path}: tag '{tag}': a figure name uses only letters, digits, _ and -")
                elif png is None:
                    errors.append(f"{nb_path}: the cell tagged '{tag}' has no image/png output "
                                  "(execute the notebook and save it with its outputs)")
                elif target in written:
                    errors.append(f"{nb_path}: tag '{tag}' is used on more than one cell")
                else:
                    target.write_bytes(png)
                    written.append(target)
    if errors:
        raise BuildError("\n".join(errors))
    return written


def inline_images(deck: Path) -> str:
    """The deck's markdown with every local image replaced by a data URI.

    Fenced code blocks are left alone, so a slide may *show* image syntax. A reference to a
    file that does not exist is an error naming it: for ``figures/`` that means no notebook
    cell carries the matching ``slide:<name>`` tag, or the notebook was not executed.
    """
    missing: list[str] = []

    def data_uri(ref: str) -> str | None:
        if re.match(r"^(?:[a-z][a-z0-9+.-]*:|//|#)", ref, re.IGNORECASE):
            return None                          # http(s):, data:, anchors: not a local file
        path = (deck.parent / ref).resolve()
        if not path.is_file():
            missing.append(ref)
            return None
        mime = IMAGE_TYPES.get(path.suffix.lower())
        if mime is None:
            raise BuildError(f"{deck}: image {ref}: use one of {', '.join(IMAGE_TYPES)}")
        return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"

    def replace(match: re.Match) -> str:
        uri = data_uri(match.group(2))
        return match.group(0) if uri is None else match.group(1) + uri + match.group(3)

    lines, fence = [], None
    for line in deck.read_text(encoding="utf-8").splitlines(keepends=True):
        marker = re.match(r"^\s*(```|~~~)", line)
        if marker and (fence is None or marker.group(1) == fence):
            fence = marker.group(1) if fence is None else None
        elif fence is None:
            line = HTML_IMAGE.sub(replace, MD_IMAGE.sub(replace, line))
        lines.append(line)
    if missing:
        raise BuildError("\n".join(f"{deck}: missing figure {ref}{figure_hint(ref)}" for ref in missing))
    return "".join(lines)


def figure_hint(ref: str) -> str:
    match = re.search(r"figures/(\d\d)_([A-Za-z0-9_-]+)\.png$", ref)
    if not match:
        return ""
    return (f" (it comes from a cell tagged '{TAG_PREFIX}{match.group(2)}' in notebooks/"
            f"{match.group(1)}_*.ipynb, saved with its outputs)")


def external_loads(html: str) -> list[str]:
    """Everything in a built deck that a browser would fetch from the network."""
    return [m.group(0)[:120] for pattern in EXTERNAL_LOADS for m in pattern.finditer(html)]


def find_marp() -> str | None:
    local = HERE / "node_modules" / ".bin" / "marp"
    return str(local) if local.exists() else shutil.which("marp")


def find_chromium() -> str | None:
    """CHROME_PATH if set, else a system Chromium/Chrome. Marp adds --no-sandbox by itself
    when it runs as root or in a container, and --disable-gpu, a fresh --user-data-dir, etc."""
    candidates = [os.environ.get("CHROME_PATH"), "/usr/bin/chromium", "/usr/bin/chromium-browser",
                  shutil.which("chromium"), shutil.which("google-chrome")]
    return next((c for c in candidates if c and Path(c).is_file()), None)


def run_marp(marp: str, source: Path, target: Path, extra: list[str]) -> None:
    command = [marp, "--no-config-file", "--html", "--allow-local-files", *extra,
               str(source), "-o", str(target)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or not target.is_file():
        raise BuildError(f"marp failed on {source.name} -> {target.name}:\n{result.stderr.strip()}")


def overflowing_pages(marp: str, source: Path, chromium: str) -> tuple[int, list[dict]]:
    """The deck's page count and its pages whose content leaves the slide or runs into the footer.

    Marp clips a slide silently: a table's last row or a figure's axis below the slide box is
    simply not projected, and nothing fails. So the deck is rendered again with Marp's bare
    template (every page laid out, none hidden by the presenter's script) and measured in headless
    Chromium (``overflow.mjs`` drives it, ``overflow.js`` measures).
    """
    bare = source.with_name(source.stem + ".bare.html")
    run_marp(marp, source, bare, ["--template", "bare"])
    done = subprocess.run(["node", str(HERE / "overflow.mjs"), chromium, str(bare)],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise BuildError(f"{source.name}: the overflow check failed (exit {done.returncode}):\n"
                         f"{done.stderr.strip()[-2000:]}")
    measured = json.loads(done.stdout)
    return measured["pages"], measured["overflows"]


def describe_overflow(finding: dict) -> str:
    """One finding of ``overflow.js`` in words: what overflows, which way and by how much."""
    where = {"top": "starts {}px above the slide", "left": "starts {}px left of the slide",
             "right": "runs {}px past the slide's right edge",
             "bottom": "ends {}px below the " + ("footer line" if finding["footer"] else "slide")}
    what = finding["text"] or "(no text)"
    return f"<{finding['element']}> \"{what}\" " + where[finding["side"]].format(finding["excess"])


def build_deck(deck: Path, out_dir: Path, marp: str | None, chromium: str | None = None,
               notebooks_dir: Path = REPO / "notebooks", pdf: bool = False, instructor: bool = False) -> list[Path]:
    """Step 2 for one deck: HTML always; with a Chromium, the overflow check and, if asked, a PDF.

    The presenting deck leaves out the debrief slides, the instructor deck keeps them (``debrief.py``).
    Without Marp only the deck's ``output`` lines and figures are checked (the caller says once
    that Marp is missing) and nothing is built.
    """
    try:  # a slide's measured sentences, printed by the notebook's cells (slides/notebook_text.py)
        markdown = select_slides(inline_images(deck), instructor)
        markdown = expand_notebook_text(markdown, deck.name[:2], notebooks_dir)
    except ValueError as error:
        raise BuildError(f"{deck}: {error}") from error
    markdown = expand_course_map(markdown, deck.name[:2])
    if marp is None:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    built = []
    with tempfile.TemporaryDirectory() as tmp:   # the inlined copy never lands in slides/
        source = Path(tmp) / deck.name
        source.write_text(markdown, encoding="utf-8")
        html = out_dir / f"{deck.stem}.html"
        run_marp(marp, source, html, [])
        loads = external_loads(html.read_text(encoding="utf-8"))
        if loads:
            raise BuildError(f"{html} would load from the network: " + "; ".join(loads))
        built.append(html)
        if chromium and pdf:
            target = out_dir / f"{deck.stem}.pdf"
            run_marp(marp, source, target, ["--pdf", "--browser", "chrome", "--browser-path", chromium,
                                            "--browser-timeout", "120"])
            built.append(target)
        if chromium:
            pages, overflows = overflowing_pages(marp, source, chromium)
            if overflows:
                raise BuildError("\n".join(f"{deck}: page {page['page']}: {describe_overflow(finding)}"
                                           for page in overflows for finding in page["findings"]))
            print(f"fits    {deck}: {pages} pages, none beyond the slide or over the footer")
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pdf", action="store_true", help="also build PDFs (needs Chromium)")
    parser.add_argument("--only", action="append", metavar="NN",
                        help="only chapter NN (repeatable, or comma-separated)")
    parser.add_argument("--notebooks", type=Path, default=REPO / "notebooks")
    parser.add_argument("--slides", type=Path, default=HERE, help="where the NN_*.md decks are")
    parser.add_argument("--out", type=Path, help="output folder (default: <slides>/build)")
    parser.add_argument("--instructor", action="store_true",
                        help="build the instructor decks, with the debrief slides, into <out>/instructor/")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # show each file as it is built, even in `make`
    only = {n.strip() for item in args.only or [] for n in item.split(",") if n.strip()} or None
    out_dir = (args.out or args.slides / "build") / ("instructor" if args.instructor else "")
    errors: list[str] = []

    try:
        for figure in extract_figures(args.notebooks, args.slides / "figures", only):
            print(f"figure  {figure}")
    except BuildError as error:
        errors.append(str(error))

    decks = chapter_files(args.slides, ".md", only)
    if not decks:
        errors.append(f"no NN_*.md deck in {args.slides}" + (f" for --only {','.join(sorted(only))}" if only else ""))
    chromium = find_chromium()
    if chromium is None:
        print("warning: no Chromium found (install it or set CHROME_PATH): "
              + ("building HTML only, " if args.pdf else "") + "pages not checked for overflow",
              file=sys.stderr)
    marp = find_marp()
    if marp is None:
        errors.append("marp not found: run `npm ci --prefix slides` first")
    for deck in decks:
        try:
            for path in build_deck(deck, out_dir, marp, chromium, args.notebooks, pdf=args.pdf,
                                   instructor=args.instructor):
                print(f"deck    {path}")
        except BuildError as error:
            errors.append(str(error))

    for line in "\n".join(errors).splitlines():
        print(f"error: {line}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
