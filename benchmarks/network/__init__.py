"""Emulated-network benchmark: W ranks in W network namespaces, joined by a rate-limited bridge.

``python -m benchmarks.network.run --help`` is the entry point; ``docs/benchmarks.md`` has the results.
"""
