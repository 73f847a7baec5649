"""Host survey: GPUs, CPU/RAM/OS/tools and the torch wheel, probed without importing torch."""
