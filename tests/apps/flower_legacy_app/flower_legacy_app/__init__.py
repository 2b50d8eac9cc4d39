"""flower-legacy-app: A Flower / PyTorch app."""
