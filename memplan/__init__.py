"""memplan: per-GPU memory of distributed training, before the job is launched."""

__version__ = "0.1.0"
