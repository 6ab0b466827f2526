# Two commands do all set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gradcoll-installed
SRC_DEPS := pyproject.toml setup.py gradcoll/kernels/_cython_kernels.pyx gradcoll/kernels/_fused.h gradcoll/kernels/_wide.h \
	gradcoll/kernels/_window_kernels.h \
	gradcoll/transport/_window_c.pyx gradcoll/transport/_window_c.pxd gradcoll/algorithms/_direct_c.pyx \
	gradcoll/transport/_tcp_io.pyx

.PHONY: test demo bench docs fuzz faults matrix install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(SRC_DEPS) | $(PY)
	$(PY) -m pip install -q "setuptools>=68" wheel "cython>=3.0" "numpy>=1.24"
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	GRADCOLL_REQUIRE_EXTENSION=1 $(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m gradcoll demo

bench: $(STAMP)
	mkdir -p build && $(PY) benches/bench_kernels.py --json build/bench_kernels.json

fuzz: $(STAMP)
	GRADCOLL_FUZZ_EXAMPLES=20000 $(PY) -m pytest -q tests/fuzz -p no:cacheprovider

# Every combination of the allreduce matrix (transport x algorithm x op x dtype x wire x deterministic x count x
# world size); `make test` runs a seeded sample of it.
matrix: $(STAMP)
	GRADCOLL_MATRIX=full $(PY) -m pytest -q tests/algorithms/test_matrix.py -p no:cacheprovider

# The whole fault matrix 3 times, the 10,000-call soak, the security scenarios, then the table of docs/reliability.md.
SECURITY_TESTS := tests/group/test_secret.py tests/group/test_duplicate_rank.py tests/group/test_close_thread.py \
	tests/group/test_one_thread.py tests/transport/test_tcp.py tests/transport/test_tcp_secure.py tests/node/test_secret.py \
	tests/transport/test_window_secret.py
faults: $(STAMP)
	mkdir -p build && rm -f build/faults.jsonl
	GRADCOLL_FAULTS=full GRADCOLL_FAULT_REPEATS=3 GRADCOLL_SOAK_ITERS=10000 GRADCOLL_FAULT_LOG=$(CURDIR)/build/faults.jsonl \
		$(PY) -m pytest -q tests/faults tests/group/test_soak.py $(SECURITY_TESTS) -p no:cacheprovider
	$(PY) benches/faults_report.py build/faults.jsonl docs/reliability.md

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

clean:
	rm -rf build *.egg-info gradcoll/*/*.so gradcoll/kernels/_cython_kernels.c gradcoll/transport/_window_c.c \
		gradcoll/algorithms/_direct_c.c gradcoll/transport/_tcp_io.c
