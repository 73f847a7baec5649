"""fdl bench: the benchmark suite (models, datasets, sweeps, reports)."""
