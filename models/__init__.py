import engine  # noqa: F401  (imports timm without wandb; see engine/__init__.py)
