"""`p2pfl compare` (what `make demo` runs): several algorithms on one split, one plot, one line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from p2pfl.cli import main
from p2pfl.config import load_config
from p2pfl.simulation import simulate
from tests.conftest import tiny_config


def _accs(run: Path) -> list[tuple[int, str, float]]:
    return [(r["round"], r["peer"], r["acc"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.timeout(240)
def test_compare_runs_every_algorithm_on_the_same_split(tmp_path: Path) -> None:
    path = tiny_config(tmp_path, rounds=2, algorithm={"name": "dfedavg", "lr": 0.1, "momentum": 0.5},
                       simulation={"workers": 1})
    out = tmp_path / "cmp"
    from p2pfl.cli import _mount, app

    _mount(["compare"])
    res = CliRunner().invoke(app, ["compare", "-c", str(path), "--algorithms", "local,dfedavg,dfedmdc:dfedmdc-demo",
                                   "--out", str(out), "-q"])
    assert res.exit_code == 0, res.output
    labels = ["local", "dfedavg", "dfedmdc-demo"]
    lines = [ln for ln in res.output.splitlines() if "final accuracy" in ln]
    assert [ln.split()[0] for ln in lines] == labels  # one summary line per algorithm, in order
    parts = {lab: (out / lab / "partition.json").read_text() for lab in labels}
    assert len(set(parts.values())) == 1  # one split for all
    table = json.loads((out / "comparison.json").read_text())
    rows = {r["algorithm"]: r for r in table["algorithms"]}
    assert list(rows) == labels and all(r["rounds"] == 2 and r["peers"] == 4 for r in rows.values())
    assert rows["local"]["bytes_sent_per_peer"] == 0 and rows["dfedavg"]["bytes_sent_per_peer"] > 0
    # dfedmdc shares its body only: less on the wire than dfedavg's whole model
    assert 0 < rows["dfedmdc-demo"]["bytes_sent_per_peer"] < rows["dfedavg"]["bytes_sent_per_peer"]
    assert (out / "comparison.png").stat().st_size > 1000
    # a plain name keeps the file's hyperparameters it has; a preset wins over the file's
    algo = {lab: yaml.safe_load((out / lab / "config.yaml").read_text())["algorithm"] for lab in labels}
    assert algo["dfedavg"]["momentum"] == 0.5 and algo["local"]["lr"] == 0.1
    assert algo["dfedmdc-demo"]["momentum"] == 0.0 and algo["dfedmdc-demo"]["lr_head"] == 0.05
    # sharing the loaded dataset and split between runs changes nothing: equal to a plain simulate
    simulate(load_config(path), tmp_path / "plain", progress=False)
    assert _accs(out / "dfedavg") == _accs(tmp_path / "plain")


@pytest.mark.parametrize("spec, words", [
    ("local,fedavgg", "unknown algorithm 'fedavgg'"),
    ("dfedmdc:dfedavg-paper", "'dfedavg-paper' is not a preset of dfedmdc"),
    ("local,local", "'local' appears twice"),
])
def test_compare_refuses_bad_entries_before_running(tmp_path: Path, spec: str, words: str, capsys) -> None:
    path = tiny_config(tmp_path)
    out = tmp_path / "cmp"
    with pytest.raises(SystemExit) as exc:
        main(["compare", "-c", str(path), "--algorithms", spec, "--out", str(out), "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and words in err[0] and "--algorithms" in err[0], err
    assert not out.exists()
