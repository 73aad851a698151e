"""A training run's settings: declared (run_config, settings), defaulted (defaults), checked (checks)."""
