# Two commands a newcomer needs: `make demo` and `make test`. Both set up what they need.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
# torch 2.14.1 / torchvision 0.29.1 are the releases this project pins for CPU hosts (a local
# wheel cache makes them fast to install; any other version downloads gigabytes).
TORCH := torch==2.14.1 torchvision==0.29.1

.PHONY: demo test lint proto data venv clean bench tools e2e

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# Fashion-MNIST: the Debian package when apt is available, else torchvision's download into ./data.
data: $(STAMP)
	@if [ -f $(FMNIST) ]; then exit 0; fi; \
	if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  (apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
	   (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null)) || true; \
	fi; \
	if [ ! -f $(FMNIST) ]; then $(BIN)/python -c "from p2pfl.data.datasets import download_fashion_mnist; download_fashion_mnist()"; fi

demo: data
	$(BIN)/p2pfl compare --config peers/demo.yaml --algorithms local,dfedavg,dfedmdc:dfedmdc-demo --out runs/demo
	$(BIN)/p2pfl simulate --config peers/flower_app.yaml --out runs/demo/flower-app

# docker-compose validates the generated compose files in tests/test_compose.py: installed with apt when
# it is missing and apt is available as root (a fresh CI machine), so those tests run instead of skipping.
tools:
	@if ! command -v docker-compose >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  (DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq docker-compose >/dev/null 2>&1 || \
	   (timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq docker-compose >/dev/null)) || \
	  echo "warning: could not install docker-compose; the compose validation tests will skip" >&2; \
	fi

test: data tools
	$(BIN)/ruff check p2pfl peers tests bench
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check p2pfl peers tests bench
	$(BIN)/lint-imports

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. p2pfl/proto/peer.proto

# The container deployment with a real Docker engine (docker/e2e.py): engine (installed and started
# if absent), local base image and wheelhouse (cached), image build, 4-peer ring, a peer killed and
# restarted, compose down. Last line: one JSON object. Needs root (dockerd, debootstrap).
e2e: $(STAMP)
	timeout 300 docker/engine.sh
	timeout 1200 docker/base-image.sh
	timeout 900 docker/wheelhouse.sh
	timeout 1500 $(BIN)/python docker/e2e.py --build-timeout 900 --timeout 900 --rounds 160

bench: data
	$(BIN)/python bench/sim_overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache
