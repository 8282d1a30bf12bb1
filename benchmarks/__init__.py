"""The benchmarks: ``network/`` (run as modules from the repository's root, ``python -m benchmarks.network.run``),
the scripts beside this file (``python benchmarks/quality.py``) and ``reporting``, what the reports share.
"""
