"""Host survey: GPUs, CPU/RAM/OS/tools and the torch wheel, probed without importing torch; and
the facts a benchmark records (facts.py)."""
