"""ScapeFSDPStrategy's set-up rules, without processes: the grid, the options, the registered names."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from unittest.mock import Mock

import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import lightning_scape
from lightning_scape.engine import fsdp_binding


def test_the_grid_puts_consecutive_ranks_in_a_group() -> None:
    grid = fsdp_binding.shard_grid(world_size=8, shard_size=4, processes_per_node=8, rank=6)
    assert (grid.replicas, grid.replica_index, grid.shard_index) == (2, 1, 2)
    assert fsdp_binding.shard_grid(world_size=8, shard_size=None, processes_per_node=2, rank=0).shard_size == 2


@pytest.mark.parametrize("shard_size", [0, 3, 16])
def test_a_shard_size_that_does_not_divide_the_world_is_refused(shard_size: int) -> None:
    with pytest.raises(ValueError, match=f"shard_size={shard_size}.*divisor of 8"):
        fsdp_binding.shard_grid(world_size=8, shard_size=shard_size, processes_per_node=8, rank=0)


def test_the_fsdp_extra_allows_exactly_the_torch_releases_the_binding_was_checked_against() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    (low_major, low_minor), (high_major, high_minor) = fsdp_binding.CHECKED_TORCH
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["fsdp"] == [f"torch>={low_major}.{low_minor},<{high_major}.{high_minor + 1}"]


@pytest.mark.parametrize(
    "cls", [lightning_scape.ScapeFSDPStrategy, lightning_scape.pytorch.ScapeFSDPStrategy], ids=["fabric", "trainer"]
)
def test_options_are_scape_config_fields(cls: type) -> None:
    strategy = cls(shard_size=2, density=0.05, dense_warmup_steps=3)
    assert strategy.scape_config == lightning_scape.ScapeConfig(density=0.05, dense_warmup_steps=3)
    with pytest.raises(TypeError, match="find_unused_parameters"):
        cls(find_unused_parameters=True)


def test_registered_as_scape_fsdp_for_fabric_and_the_trainer() -> None:
    assert dict.get(STRATEGY_REGISTRY, "scape_fsdp")["strategy"] is lightning_scape.ScapeFSDPStrategy
    assert dict.get(StrategyRegistry, "scape_fsdp")["strategy"] is lightning_scape.pytorch.ScapeFSDPStrategy


def test_the_default_wrapping_unit_is_litgpts_block() -> None:
    from litgpt.model import Block

    assert fsdp_binding.default_wrap_policy() == {Block}


def test_param_groups_are_read_where_torch_2_11_and_2_13_keep_them() -> None:
    # torch 2.13 keeps a list; torch 2.11 one group, None for a unit that owns no parameters.
    group = SimpleNamespace(fsdp_params=["p"])
    assert fsdp_binding.fsdp_param_groups(SimpleNamespace(_fsdp_param_groups=[group, group])) == [group, group]
    assert fsdp_binding.fsdp_param_groups(SimpleNamespace(_fsdp_param_group=group)) == [group]
    assert fsdp_binding.fsdp_param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
    with pytest.raises(RuntimeError, match=r"checked with: 2\.11 or 2\.13"):
        fsdp_binding.fsdp_param_groups(SimpleNamespace())


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.13.2"])
def test_the_torch_releases_the_binding_was_checked_against_are_accepted(version: str) -> None:
    fsdp_binding.require_checked_torch(version)


@pytest.mark.parametrize(
    "cls", [lightning_scape.ScapeFSDPStrategy, lightning_scape.pytorch.ScapeFSDPStrategy], ids=["fabric", "trainer"]
)
@pytest.mark.parametrize("version", ["2.10.0", "2.14.0", "3.0.0.dev20261101"])
def test_another_torch_is_refused_before_anything_starts_naming_the_range(
    cls: type, version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(RuntimeError, match=rf"checked against on torch 2\.11 to 2\.13; this is torch {version}\. "
                       r"Install a torch in that range \(pip install 'torch>=2\.11,<2\.14', which the package's "
                       r"\[fsdp\] extra asks for\)"):  # fmt: skip
        cls(shard_size=2)


@pytest.mark.parametrize("form", ["fabric", "trainer"])
def test_a_failed_run_says_nothing_at_its_end_and_waits_on_nothing(form: str) -> None:
    """As the DDP forms: a step that fails is remembered (Fabric: in the step; the Trainer: ``on_exception``), so
    that teardown closes the engines without waiting on collectives a dead peer will never finish, and neither
    the schedule's notice nor the summary is given for the failed run."""
    from lightning.fabric.plugins import Precision

    engine = Mock(step_count=3, wire=Mock(failed=False))
    if form == "fabric":
        strategy = lightning_scape.ScapeFSDPStrategy(shard_size=2)
        strategy.precision = Precision()
        optimizer = Mock(**{"step.side_effect": RuntimeError("a peer died")})
        with pytest.raises(RuntimeError, match="a peer died"):
            strategy.optimizer_step(optimizer)
    else:
        strategy = lightning_scape.pytorch.ScapeFSDPStrategy(shard_size=2)
        strategy.on_exception(RuntimeError("a peer died"))
    runtime = strategy.scape_runtime
    runtime._optimizers.append(Mock(spec=lightning_scape.ScapeOptimizer, engine=engine))
    assert runtime.failed
    runtime.log_run_summary = Mock()  # type: ignore[method-assign]
    runtime.end_of_run()
    runtime.log_run_summary.assert_not_called()


def test_load_raw_takes_a_single_file_and_no_optimizer_as_lightnings_model_parallel_strategy(tmp_path: Path) -> None:
    """Lightning's ``test_load_raw_checkpoint_validate_single_file`` and ``..._optimizer_unsupported`` for
    ``ModelParallelStrategy``, with the FSDP form (``fabric.load_raw`` calls ``load_checkpoint`` with the object)."""
    strategy = lightning_scape.ScapeFSDPStrategy()
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(ValueError, match="The given path must be a single file containing the full state dict"):
        strategy.load_checkpoint(path=folder, state=Mock(spec=nn.Module))
    unsupported = "Loading a single optimizer object from a checkpoint is not supported"
    with pytest.raises(NotImplementedError, match=unsupported):
        strategy.load_checkpoint(path=tmp_path, state=Mock(spec=torch.optim.Optimizer))


@pytest.mark.parametrize("form", ["ddp", "fsdp"])
def test_both_trainer_forms_refuse_a_fit_without_an_optimizer(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``configure_optimizers`` returning None (Lightning's ``_MockOptimizer``): what to return instead, from both
    Trainer forms (the FSDP form failed in the AdamW conversion, naming the mock)."""
    from lightning.pytorch.core.optimizer import _MockOptimizer
    from lightning.pytorch.strategies.strategy import Strategy

    def lightning_set_up(strategy: Strategy, trainer: object) -> None:
        strategy.optimizers = [_MockOptimizer()]

    monkeypatch.setattr(Strategy, "setup_optimizers", lightning_set_up)
    cls = lightning_scape.pytorch.ScapeStrategy if form == "ddp" else lightning_scape.pytorch.ScapeFSDPStrategy
    strategy = cls()
    with pytest.raises(ValueError, match=f"configure_optimizers returned None, but {cls.__name__} steps the optimizer"):
        strategy.setup_optimizers(Mock())
