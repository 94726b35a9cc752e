"""pyproxy's benchmarks: `make bench` (python -m bench.run). See bench/run.py and bench/core.py."""
