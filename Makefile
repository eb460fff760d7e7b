# Every target installs what it needs, idempotently (stamps are keyed on the pinned files).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.setup-done
NPM_STAMP := node_modules/.npm-done
# checkov pins an older boto3 than the platform: it gets a virtual environment of its own.
CHECKOV_VENV := .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.setup-done
# The Node.js package.json pins (node_modules/.bin/node: a release the CDK CLI and jsii support, 22 or
# 24; both call 20 end-of-life) runs them, whatever node the system has: first on every target's PATH
# (`npx` puts it first too). npm itself may run on any Node.
NODE_BIN := $(CURDIR)/node_modules/.bin
SYSTEM_PATH := $(PATH)
export PATH := $(NODE_BIN):$(SYSTEM_PATH)
export CDK_DISABLE_VERSION_CHECK := 1
export DS_BUILD_OPS := 0
export DS_ACCELERATOR := cpu
PYTEST_ARGS ?=

.PHONY: setup synth test test-container demo bench lint clean dist

# The three installs are independent and mostly wait on downloads: they run side by side.
setup:
	@$(MAKE) --no-print-directory -j3 $(SETUP_STAMP) $(NPM_STAMP) $(CHECKOV_STAMP)

$(SETUP_STAMP): requirements.txt requirements-dev.txt pyproject.toml constructs/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -r requirements-dev.txt -e . -e ./constructs
	$(PY) -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') and '+cu' not in v else f'torch must stay at the 2.13.0 CPU build, got {v}')"
	touch $@

$(CHECKOV_STAMP): requirements-checkov.txt
	test -x $(CHECKOV_VENV)/bin/python || python3 -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet -r requirements-checkov.txt
	touch $@

$(NPM_STAMP): package.json package-lock.json
	# npm on the system's Node: `npm ci` replaces node_modules/, the pinned Node's binary included.
	PATH="$(SYSTEM_PATH)" npm ci --no-audit --no-fund --loglevel=error
	@version=$$($(NODE_BIN)/node --version); case $$version in v22.*|v24.*) ;; *) \
	  echo "node_modules/.bin/node is Node $$version: the CDK CLI and jsii need 22 or 24 (package.json pins it)"; \
	  exit 1;; esac
	touch $@

# The two wheels a release attaches (constructs/README.md, "Install"): llm-sagemaker-platform and
# llmtrain-constructs, into dist/.
dist: setup
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w dist . ./constructs

synth: setup
	rm -rf cdk.out
	npx cdk synth --quiet --app "$(PY) app.py"
	@echo "Templates written to cdk.out/"

# One pytest run on two workers (pytest-xdist). Each test file stays on one worker (--dist loadfile),
# so a file's module-scoped torchrun launches run once; a launch alone leaves about 40% of the two
# cores idle (start-up, rendezvous, the toolkit's and the CLI's waits), which the other worker's
# files fill. tests/support/heavy_first.py starts the longest files first, in its order
# (--no-loadscope-reorder: xdist would otherwise start the files with the most tests first, and a
# one-test file of 90 s ran alone at the end). `make test PYTEST_ARGS="tests/x.py -k y"` runs what it
# names, in one process.
test: setup
ifeq ($(strip $(PYTEST_ARGS)),)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder tests
else
	$(PY) -m pytest $(PYTEST_ARGS)
endif

# The training program's tests under the torch of each platform template's container (a venv per
# torch version, .venv-torch-<version>: about 7 GB and 8 minutes the first time, kept after). Required
# before publishing a template version: docs/templates.md, "Publishing a version". Not run by CI.
test-container: setup
	$(PY) scripts/container_torch.py $(if $(TORCH),--only $(TORCH)) -- $(PYTEST_ARGS)

# The README's main command: setup, synth every environment, a local run and its resumption.
demo: synth
	scripts/demo.sh

# `make bench` (quick, this CPU, < 20 min) or `make bench MODE=full` (CUDA GPUs); docs/benchmarks.md.
# bench.plan: the run planner against memory measured here and published runs (docs/planning.md).
MODE ?= quick
bench: setup
	$(PY) -m bench.run --mode $(MODE) --out bench/results/latest.json
	$(PY) -m bench.report bench/results/latest.json
	$(PY) -m bench.plan --out bench/results/plan.json

lint: setup
	$(VENV)/bin/ruff check llmtrain training_jobs stacks constructs app.py tests scripts examples/cdk_consumer
	$(VENV)/bin/lint-imports --config pyproject.toml

clean:
	rm -rf cdk.out .pytest_cache
