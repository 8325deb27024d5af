# vllm-dp-operator: every task a developer or CI runs. `make help` lists them.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST := $(BIN)/python -m pytest
TESTBED := $(BIN)/python tests/testbed/testbed.py
IMAGES := $(BIN)/python tests/testbed/images.py
# The one list of host commands (Debian packages): `ensure` installs what a target needs as
# root, or names it and stops, before anything is built. `make host-check` shows it all.
HOSTREQS := $(PY) tests/testbed/hostreqs.py
ENGINE_IMAGE ?= vllm-dp-engine:0.1.0
OPERATOR_IMAGE ?= vllm-dp-operator:0.1.0
EXAMPLE ?=
SIM ?=
NODES ?=

.PHONY: help host-check host-install helm chart-lint venv lint lock-operator crds crds-check test test-unit test-chart test-controlplane test-reliability test-ray \
        test-vllm-contract test-cluster testbed-build kueue-build testbed-up testbed-down cluster-build cluster-up \
        cluster-down cluster-status dev dev-down bench-controlplane bench-serving bench-probes bench-p5 bench-metrics-flood \
        image engine-image kind-build e2e-kind e2e-kind-down images images-smoke builds \
        build-lane-k8s build-lane-tools build-lane-images netpol-build keda-build test-autoscaling \
        test-replicas-vllm

help: ## List targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-22s %s\n", $$1, $$2}'

host-check: ## Which host commands (Debian packages) the beds and scripts need are missing
	@$(HOSTREQS) check

host-install: ## apt-get install every missing host command (root)
	$(HOSTREQS) install

$(BIN)/python:
	@$(HOSTREQS) ensure base
	$(PY) -m venv $(VENV)

venv: $(BIN)/python ## Create .venv and install the operator, the launcher and test tools
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,ray]' -e ./engine_image

lint: ## ruff and mypy
	$(BIN)/ruff check operator engine_image tests hack bench
	$(BIN)/mypy operator/vllm_dp_operator engine_image/vllm_dp_launcher

lock-operator: $(BIN)/python ## Re-pin operator/requirements.lock (the operator image's packages, with hashes; resolves on PyPI)
	$(BIN)/python hack/lock_operator.py

crds: ## Regenerate the CRD (crds/ and the chart) from the pydantic models
	$(BIN)/python hack/gen_crds.py

crds-check: ## Fail when the checked-in CRDs drift from the models
	$(BIN)/python hack/gen_crds.py --check

test: ## Every tier that runs on this machine: unit, chart, cluster, controlplane, kind, reliability, ray (CI runs this)
	$(PYTEST) -m "not vllm and not floor and not keda and not replicas_vllm" --durations=30 tests

test-unit: ## Pure tests only (seconds)
	$(PYTEST) tests/unit

test-chart: ## Helm lint, template, RBAC shape
	$(PYTEST) tests/chart

test-controlplane: ## Real kube-apiserver, etcd, scheduler, kwok GPU nodes and KubeRay
	@$(HOSTREQS) ensure kwok
	$(PYTEST) -m controlplane tests/controlplane

test-reliability: ## Crash points, API-server/etcd restarts, watch faults, fuzzed specs, secrets (control-plane bed)
	@$(HOSTREQS) ensure kwok
	$(PYTEST) -m reliability tests/reliability

test-cluster: ## Real kubelets, containerd, CNI, kube-proxy, CoreDNS and KubeRay on this host (root)
	@$(HOSTREQS) ensure kwok cluster images
	$(PYTEST) -m "cluster and not keda and not replicas_vllm" tests/cluster

test-ray: ## The launcher on a real three-node Ray cluster on loopback addresses
	$(PYTEST) -m ray tests/ray

test-autoscaling: keda-build ## Opt-in: KEDA scales real vLLM 1 -> 2 -> 1 replicas on its queue, on the real-node bed (root; ~20 min)
	@$(HOSTREQS) ensure kwok cluster images
	$(PYTEST) -m keda tests/cluster

test-replicas-vllm: ## Opt-in: issue 37's replica scenarios on real vLLM at replicas: 2, on a four-node real-node bed (root; ~35 min)
	@$(HOSTREQS) ensure kwok cluster images
	VLLMDP_BED_NODES=4 $(PYTEST) -m replicas_vllm tests/cluster

keda-build: ## Build (or reuse) KEDA v2.21.0's images and manifests for the autoscaling tier (~8 min cold)
	@$(HOSTREQS) ensure build kwok
	$(TESTBED) keda-build

test-vllm-contract: ## Opt-in: vLLM 0.33.0's own parser and placement against our plans (~9 GB)
	$(PYTEST) -m vllm tests/vllm_contract

builds: ## Build (or reuse) everything `make test` runs: three lanes at once, then the kind tier's parts (CI runs this)
	@$(MAKE) --no-print-directory -j3 --output-sync=line build-lane-k8s build-lane-tools build-lane-images
	@t0=$$(date +%s); $(MAKE) --no-print-directory kind-build; echo "builds: kind-build in $$(( $$(date +%s) - t0 ))s"

netpol-build: ## Build (or reuse) the real-node bed's NetworkPolicy enforcer alone (kube-router; cluster-build has it)
	@$(HOSTREQS) ensure build kwok cluster
	$(TESTBED) netpol-build

# The lanes of `builds`. Each Go build already uses both cores while it compiles; run one at a
# time, the Go builds leave a core idle while they download modules and link, and the image
# builds mostly wait on Debian's packages, PyPI and the disk. The k8s.io/kubernetes commands
# stay in one lane, so no package of it is compiled twice at once; the enforcer is built in the
# tools lane before the k8s lane's cluster-build asks for it (that waits on its build lock).
build-lane-k8s:
	@t0=$$(date +%s); $(MAKE) --no-print-directory testbed-build && $(MAKE) --no-print-directory cluster-build; \
	  rc=$$?; echo "builds: lane k8s (testbed-build, cluster-build) in $$(( $$(date +%s) - t0 ))s, rc=$$rc"; exit $$rc

build-lane-tools:
	@t0=$$(date +%s); tests/chart/ensure_helm.sh >/dev/null && $(MAKE) --no-print-directory netpol-build \
	  && $(MAKE) --no-print-directory kueue-build; \
	  rc=$$?; echo "builds: lane tools (helm, netpol-build, kueue-build) in $$(( $$(date +%s) - t0 ))s, rc=$$rc"; exit $$rc

build-lane-images: $(BIN)/python
	@t0=$$(date +%s); $(MAKE) --no-print-directory images; \
	  rc=$$?; echo "builds: lane images in $$(( $$(date +%s) - t0 ))s, rc=$$rc"; exit $$rc

helm: ## Build (once) and print the pinned helm
	@tests/chart/ensure_helm.sh

chart-lint: ## helm lint the chart as shipped
	"$$(tests/chart/ensure_helm.sh)" lint charts/vllm-dp-operator

testbed-build: ## Build (or reuse) the pinned control-plane binaries
	@$(HOSTREQS) ensure build kwok
	$(TESTBED) build

kueue-build: ## Build (or reuse) Kueue v0.17.0 for the Kueue tests of the control-plane tier
	@$(HOSTREQS) ensure build kwok
	$(TESTBED) kueue-build

testbed-up: ## Start the control-plane test bed (kwok nodes)
	@$(HOSTREQS) ensure kwok
	$(TESTBED) up

testbed-down: ## Stop the control-plane test bed
	$(TESTBED) down

cluster-build: ## Build (or reuse) everything the real-node test bed runs
	@$(HOSTREQS) ensure build kwok cluster
	$(TESTBED) cluster build

cluster-up: ## Start the real-node test bed (root; NODES=4 for four nodes, default 2); prints `export KUBECONFIG=...`
	@$(HOSTREQS) ensure kwok cluster
	$(TESTBED) cluster up $(if $(NODES),--nodes $(NODES))

cluster-down: ## Stop the real-node test bed and remove everything it made on the host
	$(TESTBED) cluster down

cluster-status: ## Which components of the real-node test bed are alive
	$(TESTBED) cluster status

dev: ## Real nodes (NODES=4 for four) + helm-installed operator + real vLLM (examples/dev-cpu.yaml) until Serving, as root; SIM=1: kwok nodes
	@$(HOSTREQS) ensure base build kwok $(if $(SIM),,cluster images)
	@$(MAKE) --no-print-directory venv
	$(BIN)/python hack/dev.py up $(if $(SIM),--sim) $(if $(EXAMPLE),--example $(EXAMPLE)) $(if $(SIM),,$(if $(NODES),--nodes $(NODES)))

dev-down: ## Stop what `make dev` (either mode) started
	$(BIN)/python hack/dev.py down

bench-controlplane: ## P1-P4 of docs/benchmarks.md on the test bed; last line is one JSON object
	$(BIN)/python bench/controlplane.py $(BENCH_ARGS)

bench-serving: ## P7 of docs/benchmarks.md: 1,000 resources Serving, then hung engines (BENCH_ARGS=--quick: 50); last line is one JSON object
	$(BIN)/python bench/serving.py $(BENCH_ARGS)

bench-probes: ## P7b of docs/benchmarks.md: the probes alone in cluster-DNS mode at 1,000 resources' full cadence (no bed, ~16 min); last line is one JSON object
	$(BIN)/python bench/probe_cost.py $(BENCH_ARGS)

bench-p5: ## P5's floors by hand on real vLLM (the cluster tier's vLLM module with its floor tests; real-node bed, ~20 min)
	$(PYTEST) -m cluster tests/cluster/test_operator_vllm_cpu.py

bench-metrics-flood: ## P8 of docs/benchmarks.md: 50 engines answering a 4 MiB /metrics of made-up ranks vs honest ones (no bed, ~5 min); last line is one JSON object
	$(BIN)/python bench/metrics_flood.py $(BENCH_ARGS)

images: $(BIN)/python ## Test-bed images, no Docker (root; `make image-<name>` for one); prints the archive paths
	@$(HOSTREQS) ensure images
	$(IMAGES) build all

image-%: $(BIN)/python
	@$(HOSTREQS) ensure images
	$(IMAGES) build $*

images-smoke: $(BIN)/python ## Unpack each test-bed image and run its checks in a chroot (starts vLLM: heavy lock)
	@$(HOSTREQS) ensure images
	flock /tmp/vllmdp-heavy.lock $(IMAGES) smoke all

image: ## Operator image (needs Docker)
	docker build -t $(OPERATOR_IMAGE) .

engine-image: ## Engine image: vLLM 0.33.0 + Ray 2.60.0 + launcher (needs Docker)
	docker build -t $(ENGINE_IMAGE) engine_image

kind-build: ## Build (or reuse) what the kind tier runs: kind, kubeadm, etcd, its node image, the test images (root)
	@$(HOSTREQS) ensure base build kwok cluster images kind
	$(BIN)/python tests/testbed/kindbed.py build

e2e-kind: ## End to end on kind: its own dockerd, a node image built here, the chart, DP=2 double and dev-cpu (root)
	@$(HOSTREQS) ensure base build kwok cluster images kind
	$(PYTEST) -rs -m kind tests/e2e

e2e-kind-down: ## Remove every kind cluster, container and network of the kind tier, and its dockerd
	$(BIN)/python tests/testbed/kindbed.py down
