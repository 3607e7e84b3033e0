"""ckpt: almost-free checkpointing for PyTorch."""
__version__ = "0.1.0"
