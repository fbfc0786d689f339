"""A typical Flower PyTorch app (the shape of Flower's quickstart), used to show fedadapt's drop-in path."""
