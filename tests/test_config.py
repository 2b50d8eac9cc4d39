"""Config parsing, --set overrides and refusal of bad configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from p2pfl.config import ConfigError, apply_overrides, load_config, parse_config

BASE = {
    "seed": 1, "rounds": 3, "topology": "topology/ring-4.yaml",
    "data": {"dataset": "synthetic", "partition": {"kind": "iid"}, "batch_size": 16},
    "model": {"name": "mlp"}, "algorithm": {"name": "dfedavg", "lr": 0.1},
}


def test_overrides_are_typed_and_dotted() -> None:
    out = apply_overrides(BASE, ["rounds=7", "algorithm.name=local", "algorithm.lr=0.5", "data.partition.alpha=0.3",
                                 "network.insecure=true"])
    assert out["rounds"] == 7 and out["algorithm"]["name"] == "local" and out["algorithm"]["lr"] == 0.5
    assert out["data"]["partition"]["alpha"] == 0.3 and out["network"]["insecure"] is True
    assert BASE["rounds"] == 3  # the input is not mutated


@pytest.mark.parametrize("bad", ["rounds", "=3", "a..b=1", "rounds.x=1"])
def test_bad_overrides_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError):
        apply_overrides(BASE, [bad])


@pytest.mark.parametrize("patch, needle", [
    ({"rounds": 0}, "rounds"),
    ({"seed": -1}, "seed"),
    ({"device": "tpu"}, "device"),
    ({"tf32": "fast"}, "tf32"),
    ({"bogus": 1}, "bogus"),
    ({"data": {"dataset": "synthetic", "partition": {"kind": "iid"}, "batch_size": 0}}, "batch_size"),
    ({"data": {"dataset": "synthetic", "partitionz": {}}}, "partitionz"),
    ({"algorithm": {"lr": 0.1}}, "algorithm.name"),
    ({"network": {"quorum": 2}}, "quorum"),
    ({"network": {"speed": 2}}, "speed"),
])
def test_bad_configs_name_the_key(patch: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_config({**BASE, **patch})


def test_missing_section_is_refused() -> None:
    cfg = dict(BASE)
    del cfg["model"]
    with pytest.raises(ConfigError, match="model"):
        parse_config(cfg)


def test_load_config_file_and_demo(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(BASE))
    cfg = load_config(p, ["rounds=2"])
    assert cfg.rounds == 2 and cfg.algorithm_name == "dfedavg" and cfg.hyperparameters() == {"lr": 0.1}
    demo = load_config("peers/demo.yaml", ["algorithm.name=local", "rounds=2"])
    assert demo.algorithm_name == "local" and demo.rounds == 2
    assert len(yaml.safe_load(Path("peers/demo.yaml").read_text())) > 0


def test_unknown_preset_is_refused() -> None:
    with pytest.raises(ConfigError, match="preset"):
        parse_config({**BASE, "algorithm": {"name": "deprl", "preset": "nope"}})


def test_tf32_is_off_unless_asked() -> None:
    assert parse_config(BASE).tf32 is False
    assert parse_config({**BASE, "tf32": True}).tf32 is True
