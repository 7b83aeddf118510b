# The two set-up commands a newcomer runs (see README.md):
#   make demo   - builds .venv if needed, then runs the demo on the embedded local stack
#   make test   - builds .venv if needed, then runs the whole test suite
# A fresh machine needs only Python 3.11 and Java 17 (ZooKeeper runs from the jars that the
# pyspark wheel ships; everything else comes from PyPI, pinned in constraints.txt).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
PIP_VERSION := 26.3
STAMP  := $(VENV)/.installed

.PHONY: venv test chaos demo bench bench-storage bench-kafka bench-produce bench-replication bench-groups bench-tier bench-filters bench-delays bench-retries bench-txn bench-many-partitions bench-security bench-spark bench-latency bench-rebalance bench-partitions bench-venv bench-compare build-AdminFunction image lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "pip==$(PIP_VERSION)"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

# Two passes: the suite in $(TEST_WORKERS) processes, a test file per process at a time (its
# tests mostly wait on real servers: one process kept the 2 cores ~40% busy), then, alone, the
# tests marked `serial` (they compare a rate or a latency with another measured beside them).
TEST_WORKERS ?= 2
test: venv lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not chaos and not serial"
	$(PY) -m pytest -m serial

# the long fault-injection variants (power loss under every fsync policy, ...): a few minutes
chaos: venv
	$(PY) -m pytest -m chaos

demo: venv
	$(PY) -m infra.demo

bench-storage: venv
	$(PY) -m bench.storage_bench --write-docs

bench-produce: venv
	$(PY) -m bench.produce_bench --write-docs

bench-kafka: venv
	$(PY) -m bench.kafka_bench --write-docs

bench-replication: venv
	$(PY) -m bench.replication_bench --write-docs

bench-groups: venv
	$(PY) -m bench.group_bench --write-docs

bench-spark: venv
	$(PY) -m bench.spark_bench --write-docs

bench-tier: venv
	$(PY) -m bench.tier_bench --write-docs

bench-filters: venv
	$(PY) -m bench.filter_bench --write-docs

bench-delays: venv
	$(PY) -m bench.delay_bench --write-docs

bench-retries: venv
	$(PY) -m bench.retry_bench --write-docs

bench-txn: venv
	$(PY) -m bench.txn_bench --write-docs

# one agent, a topic of 10,000 partitions: creation, leadership, RSS, graceful restart (3 rounds)
bench-many-partitions: venv
	$(PY) -m bench.many_partitions_bench --write-docs $(BENCH_ARGS)

# TLS + SCRAM vs plaintext; BENCH_ARGS="--rounds 5 --seconds 6" for a longer run
bench-security: venv
	$(PY) -m bench.security_bench --write-docs $(BENCH_ARGS)

# `make bench` also installs the `bench` extra (peers' Python clients, nats-server, matplotlib,
# py-spy); bench-compare apt-installs redis-server and rabbitmq-server if they are missing.
BENCH_STAMP := $(VENV)/.installed-bench

bench-venv: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev,bench]"
	@touch $(BENCH_STAMP)

# 3 alternated rounds, medians (about 12 min); BENCH_ARGS="--rounds 1 --scale 0.1" for a short run
bench-compare: bench-venv
	$(PY) -m bench.compare_bench --write-docs $(BENCH_ARGS)

# end-to-end latency (HDR histograms, CDF plot); BENCH_ARGS="--soak-minutes 15" adds the soak
bench-latency: bench-venv
	$(PY) -m bench.latency_bench --write-docs $(BENCH_ARGS)

# produce p99 while a reassignment copies 1 GiB between agents, against the same load alone
bench-rebalance: bench-venv
	$(PY) -m bench.rebalance_bench --write-docs $(BENCH_ARGS)

# keyed produce/consume at 16-4,096 partitions, fsync always/interval, 3 alternated rounds
# (about 20 min); BENCH_ARGS="--quick" for a smoke run, "--agent-setting KEY=VALUE" to compare
bench-partitions: bench-venv
	$(PY) -m bench.partitions_bench --write-docs $(BENCH_ARGS)

bench: bench-venv bench-storage bench-produce bench-kafka bench-replication bench-groups bench-tier bench-filters bench-delays bench-retries bench-txn bench-many-partitions bench-security bench-spark bench-latency bench-rebalance bench-partitions bench-compare

# `sam build` (template.yaml, BuildMethod: makefile) runs this with ARTIFACTS_DIR set
build-AdminFunction:
	python3 -m infra.lambda_package "$(ARTIFACTS_DIR)"

# the agent image (infra/docker/Dockerfile; needs a container builder)
image:
	docker build -f infra/docker/Dockerfile -t strata-agent .

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

clean:
	rm -rf $(VENV) var .pytest_cache .hypothesis .mypy_cache .ruff_cache
