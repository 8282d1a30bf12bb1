"""``benchmarks/quality.py``: every configuration its tables, links and baseline name is one it can run."""

from __future__ import annotations

from benchmarks import quality


def test_every_configuration_named_is_one_the_benchmark_defines() -> None:
    named = {config for rows in quality.TABLES.values() for configs, *_ in rows for config in configs}
    named |= set(quality.GIVEN_LINKS) | set(quality.GRADIENT_STATISTIC) | set(quality.SPARSE_LR_SCALE)
    assert named <= set(quality.CONFIGS), sorted(named - set(quality.CONFIGS))
    for name in quality.CONFIGS:  # each builds a valid ScapeConfig (no option this version no longer has)
        quality.scape_config(name)
