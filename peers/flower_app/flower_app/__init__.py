"""flower-app: a Flower / PyTorch app (a small CNN on Fashion-MNIST)."""
