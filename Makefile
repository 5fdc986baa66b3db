# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.torchpulse-installed
# The CPU wheel of torch 2.13.0 is what this project is tested on; installing it
# first keeps pip from resolving `torch` to a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test test-fast lint docs bench fuzz clean

# The daemon's C parts are built at install: a change to one reinstalls.
$(STAMP): pyproject.toml $(wildcard torchpulse/*/*.c) $(wildcard torchpulse/*/*.h)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(STAMP)
	$(PY) -m torchpulse.demo

# Both tiers, one test per worker per core (pytest-xdist): most tests wait on the processes they start. Each
# worker steals from the others at the end, so one long file does not hold the run; checkpoints the tests
# share are saved once per run (tests/support/'s built_once).
TEST_WORKERS ?= auto
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# Everything that starts no process, no daemon and no Prometheus (a test there that does fails).
test-fast: $(STAMP)
	TORCHPULSE_TEST_TIER=fast $(PY) -m pytest -q -p no:cacheprovider -m "not process" $(PYTEST_ARGS)

# docs/metrics.md and dashboards/metrics.txt from torchpulse/catalog/, docs/configuration.md from the config
# code; tests/test_docs.py fails while they differ from what this writes.
docs: $(STAMP)
	$(PY) -m torchpulse.docgen

lint: $(STAMP)
	$(VENV)/bin/ruff check torchpulse tests bench fuzz deploy dashboards
	$(VENV)/bin/ruff format --check torchpulse tests bench fuzz deploy dashboards
	$(VENV)/bin/mypy

# None is a timed test: the overhead benchmarks print ratios measured side by side in one run, the others
# figures to read. The commands are the README's (its table of budgets); each runs even when one before it
# failed or read over its budget, and the target fails at the end if any did.
bench: $(STAMP)
	@status=0; \
	run() { echo "== $$*"; "$$@" || { status=1; echo "== failed or over budget: $$*"; }; }; \
	run $(PY) bench/overhead.py; \
	run $(PY) -m bench.compile_overhead --rounds 200; \
	run $(PY) bench/autograd_overhead.py --rounds 200; \
	run $(PY) bench/ingest.py; \
	run $(PY) bench/load.py --minutes 4; \
	run env PYTHONPATH=. $(PY) bench/checkpoint.py; \
	run $(PY) bench/watcher_latency.py; \
	exit $$status

# Each atheris harness for FUZZ_SECONDS; crashes land in FUZZ_ARTIFACTS. CI runs them with a fixed
# seed and run count from tests/hostile/test_fuzz.py, so its result is reproducible.
FUZZ_SECONDS   ?= 60
FUZZ_ARTIFACTS ?= /tmp/torchpulse-fuzz-artifacts
fuzz: $(STAMP)
	mkdir -p $(FUZZ_ARTIFACTS)
	for harness in fuzz/fuzz_*.py; do \
		echo "== $$harness ($(FUZZ_SECONDS) s)"; \
		$(PY) $$harness -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=3072 \
			-artifact_prefix=$(FUZZ_ARTIFACTS)/ -print_final_stats=1 || exit 1; \
	done

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache

# On a CUDA machine, in one command of at most 4 minutes: the cuda-marked tests, a real daemon with a
# CUDA-graphed job under `torchpulse run`, 2 ranks on one GPU with a DCP save, the GPU overhead benchmarks,
# and /metrics against torch's own counters (bench/gpu_check.py). No venv there: python3 from PATH, and the
# wheels it lacks from bench/gpu_wheels/. Without CUDA, GPU_CHECK_ARGS=--dry-run runs the CPU parts.
.PHONY: gpu-check
gpu-check:
	$(if $(wildcard $(PY)),$(PY),python3) bench/gpu_check.py $(GPU_CHECK_ARGS)
