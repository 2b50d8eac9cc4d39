"""The checks bench/soak.py reports (issue 68, "How it is shown"), on hand-made records: each one fails
on the fault it is there to catch, so an ``ok`` soak line means what it says."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from p2pfl.topology import generate

ROOT = Path(__file__).resolve().parents[1]


def _soak():
    spec = importlib.util.spec_from_file_location("soak_bench", ROOT / "bench" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["soak_bench"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


soak = _soak()
TOPO = generate("directed_ring", 3, base_port=40000)  # p0 -> p1 -> p2 -> p0


def rec(pid: str, r: int, **kw) -> dict:
    return {"round": r, "peer": pid, "missing": [], **kw}


def clean(rounds: int = 4) -> dict[str, list[dict]]:
    return {p: [rec(p, r) for r in range(rounds)] for p in TOPO.ids}


def test_exactly_once_accepts_a_clean_run_and_an_announced_fast_forward() -> None:
    assert soak.exactly_once(clean(), 4, TOPO)["exactly_once"]
    recs = clean(6)
    # p1 skipped rounds 2-3 (fast-forward), so p2 could not mix them: it says p1 was missing
    recs["p1"] = [rec("p1", 0), rec("p1", 1), rec("p1", 4, fast_forward_from=2), rec("p1", 5)]
    recs["p2"][2]["missing"] = recs["p2"][3]["missing"] = ["p1"]
    got = soak.exactly_once(recs, 6, TOPO)
    assert got["exactly_once"] and got["rounds_skipped_by_fast_forward"]["p1"] == 2, got


def test_exactly_once_catches_a_duplicate_a_silent_gap_a_short_run_and_a_mixed_round_unrecorded() -> None:
    recs = clean()
    recs["p0"].append(rec("p0", 1))  # round 1 again after round 3
    assert soak.exactly_once(recs, 4, TOPO)["duplicates"] == [["p0", 1], ["p0", "out of order"]]
    recs = clean()
    del recs["p0"][2]  # round 2 gone, no fast_forward_from: lost (and p1 mixed it)
    got = soak.exactly_once(recs, 4, TOPO)
    assert not got["exactly_once"] and got["missing"] == [["p0", 2]]
    assert got["mixed_but_unrecorded"] == [["p0", 2, "p1"]]
    recs = clean(6)
    recs["p1"] = [rec("p1", 0), rec("p1", 1), rec("p1", 4, fast_forward_from=1), rec("p1", 5)]
    assert soak.exactly_once(recs, 6, TOPO)["inconsistent_fast_forward"] == [["p1", 4, 1, 1]]
    recs = clean()
    recs["p2"].pop()  # never finished
    assert soak.exactly_once(recs, 4, TOPO)["missing"] == [["p2", 3]]


def test_mass_error_and_nan() -> None:
    recs = {p: [rec(p, r, mu=1.0) for r in range(3)] for p in TOPO.ids}
    assert soak.mass_errors(recs, 3) == {0: 0.0, 1: 0.0, 2: 0.0}
    recs["p1"][1]["mu"] = 1.5  # half a share counted twice in round 1, settled in round 2
    assert soak.mass_errors(recs, 3) == {0: 0.0, 1: 0.5, 2: 0.0} and soak.final_mass_error(recs, 3) == 0.0
    del recs["p2"][2]  # a fast-forward (or the end) of p2: its last mu still counts
    assert soak.mass_errors(recs, 3)[2] == 0.0
    recs["p0"][0]["loss"] = float("nan")
    assert soak.nan_count(recs) == 1


def test_a_fast_forward_beyond_every_honest_round_is_reported(tmp_path: Path) -> None:
    dirs = {p: tmp_path / p for p in TOPO.ids}
    for d in dirs.values():
        d.mkdir()

    def write(pid: str, recs: list[dict]) -> None:
        with open(dirs[pid] / f"metrics-{pid}.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)

    prog = soak.Progress(dirs)
    write("p0", [rec("p0", r) for r in range(5)])
    write("p1", [rec("p1", 0), rec("p1", 5, fast_forward_from=1)])  # p0 is in round 5: proven, fine
    prog.poll()
    assert prog.unjustified() == [] and prog.lead(TOPO.ids) == 6 and prog.round_of("p2") == 0
    write("p2", [rec("p2", 0), rec("p2", 40, fast_forward_from=1)])  # nobody was anywhere near 40
    prog.poll()
    assert prog.bad == [] and len(prog.waiting) == 1  # one poll of slack (the order files are read in)
    prog.poll()
    assert prog.bad == prog.unjustified() == [{"peer": "p2", "from": 1, "to": 40, "reached": 6}]
    # a metrics file rewritten (resume: atomic replace) is read again from its start, nothing counted twice
    (dirs["p0"] / "metrics-p0.jsonl").unlink()
    write("p0", [rec("p0", r) for r in range(3)])
    prog.poll()
    assert [r["round"] for r in prog.tails["p0"].recs] == [0, 1, 2]


def test_the_accuracy_check_is_a_prediction_interval_that_refuses_an_outlier() -> None:
    # 3 fault-free runs of mean 0.5 and sample std 0.01: t(2) = 4.303, sqrt(1 + 1/3) = 1.1547 -> 0.0497
    half = soak.prediction_half_width(0.01, 3)
    assert abs(half - 0.04969) < 1e-4
    assert soak.prediction_half_width(0.01, 1) is None
    assert soak.prediction_half_width(0.01, 12) < soak.prediction_half_width(0.01, 4)  # df 11 -> the table's 10

    def acc_recs(acc: float) -> dict:
        return {p: [rec(p, 0, acc=acc)] for p in TOPO.ids}

    class R:  # the fields of soak.Run that summarize reads
        def __init__(self, acc: float) -> None:
            self.recs, self.wall_s, self.hostile, self.unjustified_ff = acc_recs(acc), 1.0, {}, []
            self.failed, self.timed_out, self.restarts = [], False, {}

    cleans = {1: R(0.49), 2: R(0.50), 3: R(0.51)}
    inside = soak.summarize("pull", R(0.54), cleans, [], 3, 1, TOPO, "hook")
    assert inside["accuracy"]["within_prediction_95"] and not inside["accuracy"]["within_2std"]
    assert inside["ok"]
    outside = soak.summarize("pull", R(0.56), cleans, [], 3, 1, TOPO, "hook")
    assert outside["accuracy"]["within_prediction_95"] is False and not outside["ok"]
