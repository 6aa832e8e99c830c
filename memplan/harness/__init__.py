"""Ground truth: run the strategy for real on torch.distributed and measure every rank."""
