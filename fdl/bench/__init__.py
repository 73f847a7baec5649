"""fdl bench: the benchmark suite (models, datasets, sweeps, their files and report); fdl compare
is fdl/compare."""
