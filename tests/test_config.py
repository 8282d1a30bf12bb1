from __future__ import annotations

import pickle

import pytest

from lightning_scape import ScapeConfig


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"density": 0.0}, "density=0.0 must lie in (0, 1]"),
        ({"density": 1.5}, "density=1.5 must lie in (0, 1]"),
        ({"density": float("nan")}, "density=nan"),
        ({"chunk_size": 1000}, "chunk_size=1000 must be a power of two"),
        ({"chunk_size": 65536}, "chunk_size=65536 must be a power of two between 1 and 32768"),
        ({"chunk_size": 0}, "chunk_size=0"),
        ({"exploration": 1.0}, "exploration=1.0 must lie in [0, 1)"),
        ({"exploration": -0.1}, "exploration=-0.1"),
        ({"density_ramp_steps": -1}, "density_ramp_steps=-1"),
        ({"mask_delay": -1}, "mask_delay=-1 must be 1"),
        ({"mask_delay": 2}, "mask_delay=2 must be 1 (overlaps the mask all-gather) or 0"),
        ({"dense_warmup_steps": -5}, "dense_warmup_steps=-5"),
        ({"catch_up_cap": 0.5}, "catch_up_cap=0.5"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb=0"),
    ],
)
def test_invalid_configuration_says_what_to_change(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match="Invalid ScapeConfig") as err:
        ScapeConfig(**changes)  # type: ignore[arg-type]
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("name", "advice"),
    [
        ("density_ramp_shape", "always geometric"),
        ("mask_statistic", "first-moment statistic"),
        ("mask_refresh_interval", "every step"),
        ("seed", "nothing in SCAPE draws random numbers"),
        ("collective_timeout_s", "ScapeStrategy(timeout=datetime.timedelta(seconds=...))"),
        ("resume_with_new_config", "ScapeStrategy(resume_with_new_config=True)"),
    ],
)
def test_an_option_of_an_earlier_version_says_what_replaces_it(name: str, advice: str) -> None:
    with pytest.raises(TypeError, match=f"ScapeConfig has no option '{name}' any more") as err:
        ScapeConfig(density=0.1, **{name: 1})
    assert advice in str(err.value)
    with pytest.raises(TypeError, match=f"has no option '{name}'"):  # replace() builds a new ScapeConfig
        ScapeConfig().replace(**{name: 1})


def test_a_configuration_saved_by_an_earlier_version_reads_back_without_its_removed_options() -> None:
    cfg = ScapeConfig(density=0.05, mask_delay=0)
    old = {**cfg.to_dict(), "density_ramp_shape": "geometric", "mask_statistic": "momentum", "seed": 0}
    assert ScapeConfig.from_dict(old) == cfg == ScapeConfig.from_dict(cfg.to_dict())
    with pytest.raises(TypeError, match="unexpected keyword argument 'densty'"):  # a typo is no removed option
        ScapeConfig.from_dict({**cfg.to_dict(), "densty": 0.1})


def test_by_default_scape_chooses_the_form_and_starts_dense_while_it_measures() -> None:
    cfg = ScapeConfig()
    assert cfg.density is None and cfg.wire_format is None and cfg.chooses_form
    start = cfg.start_form()  # fp32 dense steps until the first decision; buffers for any form it may choose
    assert start.wire_format == "full" and start.dense_steps >= 10**9 and start.max_slots(4096) == 1024
    with pytest.raises(ValueError, match="leaves the density to SCAPE"):
        cfg.slots_per_chunk  # noqa: B018
    # Setting either fixes the form, as before: wire_format alone keeps d = 0.01.
    assert not ScapeConfig(density=0.05).chooses_form and ScapeConfig(wire_format="int8").slots_per_chunk == 41


def test_defaults_follow_the_spec() -> None:
    cfg = ScapeConfig(density=0.01)
    assert cfg.density == 0.01 and cfg.chunk_size == 4096 and cfg.sharded
    assert cfg.mask_delay == 1
    assert cfg.exploration == 0.1
    # Settled by benchmarks/quality.py (docs/algorithm.md section 7).
    assert cfg.catch_up_cap == 32.0 and cfg.dense_warmup_steps == 30 and cfg.density_ramp_steps == 400
    # The ramp's steps denser than 1/4 are sent dense: 0.01 ** (s / 400) > 1/4 for s <= 120.
    assert cfg.dense_steps == 150 and cfg.slots_at(151) == round(0.01 ** (121 / 400) * 4096) == 1017
    # k_c = round(d C) = round(40.96) = 41 slots; k_e = round(0.1 * 41) = 4.
    assert cfg.slots_per_chunk == 41 and cfg.explore_slots_per_chunk == 4
    assert cfg.effective_density == pytest.approx(41 / 4096)


def test_small_density_keeps_one_slot_per_chunk() -> None:
    cfg = ScapeConfig(density=1e-6, chunk_size=64)
    assert cfg.slots_per_chunk == 1


def test_replace_validates_and_config_pickles() -> None:
    cfg = ScapeConfig(density=0.1)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert cfg.replace(sharded=False, catch_up_cap=4.0).catch_up_cap == 4.0
    with pytest.raises(ValueError):
        cfg.replace(density=2.0)
