"""Shared machinery: config, distributed setup, the training loop, metrics, checkpoints, logging."""
