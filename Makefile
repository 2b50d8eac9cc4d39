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

.PHONY: demo test lint proto data venv clean bench

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
	$(BIN)/p2pfl simulate --config peers/demo.yaml --out runs/demo

test: data
	$(BIN)/ruff check p2pfl peers tests bench
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check p2pfl peers tests bench

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. p2pfl/proto/peer.proto

bench: data
	$(BIN)/python bench/sim_overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache
