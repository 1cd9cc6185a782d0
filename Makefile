# timeslice-dra developer commands. `make help` lists them.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# + the frameworks timeslice.integrations is tested with (extra `integrations-test`)
INTEGRATIONS := $(VENV)/.installed-integrations
ARGS ?=
CHART := manifests/helm/timeslice-dra
K8S_VERSION := $(shell sed -n 's/^K8S_VERSION=//p' hack/versions.env)

.PHONY: help demo test unit unit-all e2e lint protos wheels cluster-up cluster-down bench stress-test

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml setup.py shim/timeslice_vmm.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

$(INTEGRATIONS): $(STAMP)
	$(BIN)/pip install -q -e '.[dev,integrations-test]'
	touch $@

demo: $(STAMP) ## run the demo: orchestrator, node agent and 2 synthetic RL jobs (ARGS="--json ...")
	$(BIN)/timeslice demo $(ARGS)

test: lint unit-all e2e ## the whole suite: lint, unit + integration (slow ones too), e2e on a local cluster

unit: $(STAMP) ## unit and integration tests without those marked slow (> 5 s each): the quick loop (integration tests of timeslice.integrations run once unit-all installed their frameworks)
	$(BIN)/pytest -q -m "not slow" tests

unit-all: $(INTEGRATIONS) ## every unit and integration test (real gRPC servers and processes, a real Prometheus scrape; GPU tests skip without a GPU)
	@command -v prometheus >/dev/null || apt-get install -y -q --no-install-recommends prometheus >/dev/null
	TIMESLICE_TEST_INTEGRATIONS=required $(BIN)/pytest -q tests

lint: $(STAMP) ## ruff, mypy (orchestrator, node agent), shellcheck, YAML parses, generated stubs match proto/, helm lint + template (builds helm)
	$(BIN)/ruff check .
	$(BIN)/python hack/typecheck.py
	$(BIN)/python hack/gen_protos.py --check
	@command -v shellcheck >/dev/null || apt-get install -y -q shellcheck >/dev/null
	shellcheck hack/*.sh .ci/run
	$(BIN)/python -c "import glob, yaml; [list(yaml.safe_load_all(open(f))) for f in \
	  glob.glob('manifests/**/*.yaml', recursive=True) + glob.glob('hack/**/*.yaml', recursive=True) \
	  if '/templates/' not in f]"
	hack/helm.sh lint --strict $(CHART)
	hack/helm.sh lint --strict $(CHART) --values hack/local-helm-values.yaml
	hack/helm.sh template timeslice-dra $(CHART) --kube-version $(K8S_VERSION) >/dev/null
	hack/helm.sh template timeslice-dra $(CHART) --kube-version $(K8S_VERSION) --values hack/local-helm-values.yaml >/dev/null

protos: $(STAMP) ## regenerate the gRPC stubs from proto/
	$(BIN)/python hack/gen_protos.py

wheels: $(STAMP) ## build the timeslice wheel into dist/ (for the cluster's Python image)
	rm -rf dist && $(BIN)/pip wheel -q --no-deps -w dist .

e2e: wheels ## bring up the local cluster (built from source, cached), run e2e/, tear it down
	hack/e2e.sh

stress-test: wheels ## the suite under load: unit 5 times, e2e once and 1000 randomized schedules per backend while stress-ng keeps every core busy
	hack/stress-test.sh

cluster-up: wheels ## start the local single-node cluster (hack/local-cluster.sh up)
	hack/local-cluster.sh up --wheels dist

cluster-down: ## stop it and remove its state
	hack/local-cluster.sh down

bench: $(STAMP) ## CPU benchmarks, overwriting bench/results/ (GPU and cluster ones: docs/results.md)
	$(BIN)/python bench/handoff.py --groups 100 --jobs 8 --hold 1.0 --seconds 20 --out bench/results/handoff-2core.json
