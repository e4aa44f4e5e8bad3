"""Datasets, transforms and loaders: `build_data(cfg.data, ...)` is the entry point."""
