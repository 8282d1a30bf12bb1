"""The wheel a user installs: built from this checkout, installed into a fresh environment, used from outside.

The fresh environment reuses this environment's installed dependencies (torch, Lightning, litgpt, ...) through
a path file, so that no download is needed; ``lightning_scape`` itself comes only from the wheel: the
checkout is neither installed there nor on the path, and the test checks where every module was imported from.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Run inside the fresh environment, from a folder outside the checkout.
USER_SCRIPT = textwrap.dedent(
    """
    import importlib, json, os, pkgutil, sys
    import lightning_scape

    root = os.path.dirname(lightning_scape.__file__)
    modules = sorted(m.name for m in pkgutil.walk_packages(lightning_scape.__path__, "lightning_scape."))
    files = {name: importlib.import_module(name).__file__ for name in modules}
    outside = {name: f for name, f in files.items() if not f.startswith(root)}

    import lightning as L
    import torch

    def train(fabric):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, opt = fabric.setup(model, opt)
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(fabric.global_rank))
        losses = []
        for _ in range(6):  # one batch per rank, fitted again and again: the loss must fall
            loss = (model(x) - x[:, :1]).pow(2).mean()
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        engine = fabric.strategy.engine
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = fabric.all_gather(params)
        return {
            "losses": losses,
            "sparse_steps": engine.step_count - engine.config.dense_steps,
            "sent": engine.counters.total_sent_bytes,
            "dense_equivalent": engine.counters.total_dense_equivalent,
            "replicas_equal": bool((gathered[0] == gathered[1]).all()),
        }

    from lightning_scape.litgpt.pretrain import parse, shipped_recipes

    recipes = {name: str(path) for name, path in shipped_recipes().items()}
    hyperparameters, _ = parse(["--config", "debug"])  # a shipped recipe, by name

    strategy = lightning_scape.ScapeStrategy(density=0.1, dense_warmup_steps=1, density_ramp_steps=0)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    result = train(fabric)
    if fabric.global_rank == 0:
        summary = {"root": root, "modules": modules, "outside": outside, "recipes": recipes}
        summary["debug_model"] = hyperparameters["model_name"]
        print("RESULT " + json.dumps({**summary, **result}))
    """
)


def _tracked_copy(dest: Path) -> Path:
    """The checkout's tracked files, links kept as links: a build there cannot pick up stale build/ output."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    for name in files.decode().split("\0"):
        if not name:
            continue
        src, dst = REPO / name, dest / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)
    return dest


def _fresh_environment(tmp: Path) -> Path:
    """A new virtual environment whose site-packages also sees this environment's dependencies."""
    env = tmp / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    fresh_site = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    # A path line adds our site-packages without running its .pth files, so the editable finder that maps
    # lightning_scape to the checkout stays out: the package can only come from the wheel.
    Path(fresh_site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env


@pytest.mark.dist
def test_built_wheel_installs_imports_every_module_and_trains(tmp_path: Path) -> None:
    wheel_dir = tmp_path / "wheel"
    source = _tracked_copy(tmp_path / "source")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheel_dir), "."],
        cwd=source,
        check=True,
        capture_output=True,
    )
    (wheel,) = wheel_dir.glob("lightning_scape-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    # Every package of the checkout is in the wheel (discovered, never listed), the kernels and recipes too.
    packages = {str(p.parent.relative_to(source)) for p in (source / "lightning_scape").rglob("__init__.py")}
    assert {f"{p}/__init__.py" for p in packages} <= set(names)
    assert "lightning_scape/kernels/sparse_adams.py" in names
    assert {f"lightning_scape/recipes/{r.name}" for r in (source / "lightning_scape/recipes").glob("*.yaml")} <= set(
        names
    )

    env = _fresh_environment(tmp_path)
    pip_env = {**os.environ, "PIP_NO_INDEX": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(env / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        env=pip_env,
    )
    user = tmp_path / "user"
    user.mkdir()
    (user / "train.py").write_text(USER_SCRIPT)
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    out = subprocess.run(
        [str(env / "bin" / "python"), "train.py"], cwd=user, env=clean, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["root"].startswith(str(env)), result["root"]
    assert not result["outside"]
    shipped = {r.stem for r in (source / "recipes").glob("*.yaml")}
    assert set(result["recipes"]) == shipped
    assert all(path.startswith(result["root"]) for path in result["recipes"].values())
    assert result["debug_model"] == "scape-debug"
    expected = {
        p.relative_to(source).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
        for p in (source / "lightning_scape").rglob("*.py")
    }
    assert expected - {"lightning_scape"} <= set(result["modules"])
    assert result["sparse_steps"] == 5
    assert result["replicas_equal"]
    assert 0 < result["sent"] < result["dense_equivalent"]
    assert result["losses"][-1] < result["losses"][0]

    cli = subprocess.run(
        [str(env / "bin" / "lightning-scape"), "--version"], cwd=user, env=clean, capture_output=True, text=True
    )
    assert cli.returncode == 0 and "lightning-scape 0." in cli.stdout, cli.stdout + cli.stderr
