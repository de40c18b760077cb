"""Benchmark scripts (``python -m benchmarks.<name>``): each prints a table and writes JSON to
``benchmarks/results/``. A package, so tests import them as ``benchmarks.<name>`` through the
repository root on pytest's ``pythonpath`` (pyproject.toml), never through ``sys.path`` edits."""
