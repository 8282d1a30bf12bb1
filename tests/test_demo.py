"""The README demo end to end, shortened: 2 gloo processes per method, a few steps, on a folder of text."""

from __future__ import annotations

import csv
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import write_corpus

from lightning_scape.examples.demo import (
    CSV_COLUMNS,
    DemoOptions,
    _index_exchange_notes,
    method_config,
    speed_phrase,
)
from lightning_scape_cli import COMMANDS, demo_command, demo_parser, main

STEPS, EVAL_EVERY = 6, 4


def _short_run(corpus: Path, out: Path) -> list[str]:
    """The demo's arguments for a few steps of a tiny model on ``corpus``, two of them dense."""
    argv = ["--steps", str(STEPS), "--dense-warmup-steps", "2", "--density-ramp-steps", "0"]
    argv += ["--batch-size", "2", "--block-size", "64"]
    return [*argv, "--eval-every", str(EVAL_EVERY), "--data", str(corpus), "--out", str(out)]


@pytest.mark.dist
def test_demo_on_a_text_folder_writes_table_csv_and_png(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_SCAPE_CACHE", str(tmp_path / "cache"))  # TextFolder's token cache
    corpus, out = tmp_path / "corpus", tmp_path / "out"
    write_corpus(corpus, 30, words=400)
    dense, scape = demo_command(_short_run(corpus, out))  # the default: the int8 wire at d = 0.025
    captured = capfd.readouterr()  # capfd: the spawned processes' log lines too
    text, logs = captured.out, captured.out + captured.err
    assert "DDP + AdamS" in text and "SCAPE int8 d=0.025" in text and "kB sent per step" in text
    assert "DDP + AdamS (one fp32 all-reduce of every gradient per step, what DDP sends" in text
    assert "SCAPE int8 d=0.025 (after 2 dense warm-up steps" in text and "of the values as 8-bit codes" in text
    # The baseline runs no SCAPE schedule and does not log one; the SCAPE run logs its own, once.
    banners = [line for line in logs.splitlines() if line.startswith("lightning_scape: SCAPE on")]
    assert len(banners) == 1 and "the first 2 steps dense" in banners[0], banners
    assert str(out / "demo.csv") in text and str(out / "demo.png") in text
    # Distinct column heads: the steps after SCAPE's warm-up, and the whole run.
    head = next(line for line in text.splitlines() if line.startswith("method"))
    assert head.split() == ["method", "tokens/s", *["steps", "3-6", "steps", "1-6"] * 2, "train", "loss", "val", "loss"]
    table = text.split(head, 1)[1].splitlines()[1:3]  # the two rows under the head
    rows = {line[:18].strip(): line[18:].split() for line in table}
    assert set(rows) == {"DDP + AdamS", "SCAPE int8 d=0.025"}
    assert float(rows["SCAPE int8 d=0.025"][1]) == pytest.approx(scape["bytes_per_step"] / 1e3, abs=0.05)
    assert float(rows["SCAPE int8 d=0.025"][2]) == pytest.approx(scape["bytes_per_step_all"] / 1e3, abs=0.05)
    # The notes say what the numbers mean, with this run's quality gap and throughput.
    gap = scape["val_loss"] - dense["val_loss"]
    assert f"Quality: SCAPE ends {abs(gap):.3f} nats" in text and ("above" if gap >= 0 else "below") in text
    assert "loopback, which is never the" in text and "benchmarks/network/" in text
    # The throughput sentence is this run's own (which one depends on the machine's load: speed_phrase's test
    # below checks each), wherever the notes' line breaks fall.
    assert speed_phrase(scape, dense) in " ".join(text.split())
    # A sparse step of the int8 wire: (W-1)/W d N (2 + 8/k + b_i) against DDP's 2 (W-1)/W N 4, about 1/75 here;
    # its dense steps a quarter of DDP's, the next mask's indices included: no step sends more than DDP, and no
    # note names one (the fp32 wire's last dense step does: the next test).
    assert dense["bytes_per_step"] / 90 < scape["bytes_per_step"] < dense["bytes_per_step"] / 50
    assert all(s < d / 3 for s, d in zip(scape["bytes_sent"], dense["bytes_sent"], strict=True))
    assert scape["index_bytes"][1] > 0 and not any(dense["index_bytes"])
    assert "SCAPE's last dense step, sends" not in " ".join(text.split())
    # Dense: one all-reduce of the padded flat buffer, 2 (W-1)/W N b with W = 2, b = 4.
    assert dense["bytes_per_step"] == dense["padded_params"] * 4
    assert dense["dense_equivalent_per_step"] == dense["params"] * 4
    # With the warm-up counted, SCAPE's average lies between its sparse steps and a dense step.
    assert scape["bytes_per_step"] < scape["bytes_per_step_all"] < dense["bytes_per_step_all"]
    for r in (dense, scape):
        assert 0.0 < r["val_loss"] < 6.0 and r["tokens_per_s"] > 0
        assert sorted(r["val_losses"]) == [EVAL_EVERY, STEPS] and r["val_losses"][STEPS] == r["val_loss"]
    # Both runs start from the same weights and see the same batches (then SCAPE's steps are int8-rounded).
    assert dense["train_losses"][0] == scape["train_losses"][0]

    assert b"\r" not in (out / "demo.csv").read_bytes()  # plain \n line endings
    with open(out / "demo.csv", newline="") as fh:
        reader = csv.reader(fh)
        assert tuple(next(reader)) == CSV_COLUMNS
        rows = [dict(zip(CSV_COLUMNS, row, strict=True)) for row in reader]
    assert [r["method"] for r in rows] == ["dense"] * STEPS + ["scape"] * STEPS
    for result in (dense, scape):
        mine = [r for r in rows if r["method"] == result["method"]]
        assert [int(r["step"]) for r in mine] == list(range(1, STEPS + 1))
        sent = [int(r["bytes_sent"]) for r in mine]
        cumulative = [int(r["cumulative_bytes_sent"]) for r in mine]
        assert all(b >= a for a, b in itertools.pairwise(cumulative))
        assert cumulative[-1] == result["total_bytes"] == sum(sent)  # warm-up included
        assert [float(r["train_loss"]) for r in mine] == pytest.approx(result["train_losses"], abs=1e-6)
        assert [int(r["step"]) for r in mine if r["val_loss"]] == [EVAL_EVERY, STEPS]
        assert float(mine[-1]["val_loss"]) == pytest.approx(result["val_loss"], abs=1e-6)

    png = (out / "demo.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_the_fp32_wires_last_dense_step_is_named_where_it_sends_the_first_masks_indices() -> None:
    # On the fp32 wire the last dense step sends DDP's bytes plus the first sparse step's mask indices, all-gathered
    # a step ahead (mask_delay=1); a scalar all-reduce's few bytes are not named.
    dense = {"bytes_sent": [1000, 1000, 1000, 1000], "index_bytes": [0, 0, 0, 0]}
    scape = {"bytes_sent": [1004, 1300, 30, 30], "index_bytes": [0, 296, 0, 0]}
    (note,) = _index_exchange_notes(dense, scape)
    assert note.startswith("Step 2, SCAPE's last dense step, sends 300 B more than DDP + AdamS") and "296 B" in note


def test_both_runs_are_fixed_forms_and_the_baseline_sends_every_step_dense() -> None:
    # Left to choose its form, the baseline measured the link (its probes added 8.6% to its bytes over the 300
    # steps) and could have turned sparse on a slow-looking loopback.
    args = DemoOptions(**vars(demo_parser().parse_args([]))).run_args()
    dense, scape = method_config(args, "dense"), method_config(args, "scape")
    assert not dense.chooses_form and not scape.chooses_form
    assert dense.wire_format == "full" and dense.dense_warmup_steps > args.steps and not dense.sharded


def test_speed_note_calls_a_difference_below_half_a_percent_noise_and_signs_the_rest() -> None:
    def phrase(scape_tokens_per_s: float) -> str:
        return speed_phrase({"tokens_per_s": scape_tokens_per_s}, {"tokens_per_s": 1000.0})

    for same in (1000.0, 996.0, 1004.9):  # -0.4% .. +0.49%: never a signed "0%"
        assert phrase(same) == "the two throughputs are the same within noise."
    assert "SCAPE's tokens/s are 2.0% lower than DDP + AdamS's" in phrase(980.0)
    assert "SCAPE's tokens/s are 0.6% higher than DDP + AdamS's" in phrase(1006.0)
    assert "-" not in phrase(900.0).split("tokens/s are")[1].split("%")[0]


@pytest.mark.dist
def test_missing_data_path_is_a_one_line_error_from_the_command_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-folder"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_scape", "demo", "--data", str(missing), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"--data {missing}: no such file or directory" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_folder_without_text_is_refused_before_any_process_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_SCAPE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.bin").write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(SystemExit) as exit_info:
        demo_command(["--data", str(tmp_path / "bin"), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"lightning-scape demo: error: the text at {tmp_path / 'bin'}: " in err and "no readable text files" in err
    assert not (tmp_path / "out").exists()


def test_invalid_scape_setting_is_refused_before_any_process_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        demo_command(["--density", "2"])
    assert exit_info.value.code == 2 and "density=2.0 must lie in (0, 1]" in capsys.readouterr().err


def test_cli_describes_each_command_and_names_an_unknown_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, description in COMMANDS.items():  # one line per command: its name, then what it does
        assert any(line.split(None, 1) == [name, description] for line in lines), lines
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'; the commands are demo, pretrain, estimate" in capsys.readouterr().err
    assert main(["--frobnicate"]) == 2 and "unknown option '--frobnicate'" in capsys.readouterr().err


@pytest.mark.dist
def test_help_answers_without_importing_torch() -> None:
    """``lightning-scape --help``, ``demo --help`` and a bad demo value, in a fresh interpreter: no torch."""
    script = (
        "import sys, lightning_scape_cli as cli\n"
        "assert cli.main(['--help']) == 0\n"
        "for argv in (['demo', '--help'], ['demo', '--steps', 'many']):\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit as exc:\n"
        "        print('exit', exc.code)\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--dense-warmup-steps" in proc.stdout and "exit 0" in proc.stdout and "exit 2" in proc.stdout
    assert "invalid int value: 'many'" in proc.stderr
    assert proc.stdout.rstrip().endswith("torch imported: False"), proc.stdout
