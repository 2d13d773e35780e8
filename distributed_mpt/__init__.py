"""Mixed-precision CIFAR-10 training on one GPU, all GPUs of a node, or many nodes."""

__version__ = "0.1.0"
