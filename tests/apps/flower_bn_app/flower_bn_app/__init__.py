"""flower-bn-app: A Flower / PyTorch app."""
