"""Topology files: validation, mixing matrices, spectral gap, random schedules, generators and the CLI."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from p2pfl.cli.topology import app
from p2pfl.topology import (
    MixingPlan,
    Topology,
    TopologyError,
    generate,
    load_topology,
    parse_topology,
    spectral_gap,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "topology").glob("*.yaml"))


def ring(n: int = 4, **extra: Any) -> dict[str, Any]:
    """A valid undirected ring as raw file data, to be broken by each bad case."""
    data: dict[str, Any] = {
        "name": f"ring-{n}",
        "directed": False,
        "peers": [{"id": f"p{i}", "address": f"127.0.0.1:{50050 + i}"} for i in range(n)],
        "edges": [[f"p{i}", f"p{(i + 1) % n}"] for i in range(n)],
        "weights": "metropolis",
    }
    data.update(extra)
    return data


def explicit(rows: list[list[float]]) -> dict[str, Any]:
    return {"kind": "explicit", "matrix": rows}


# A valid symmetric doubly-stochastic explicit matrix on ring-4 (neighbours 0.25, self 0.5).
GOOD_RING4 = [
    [0.5, 0.25, 0.0, 0.25],
    [0.25, 0.5, 0.25, 0.0],
    [0.0, 0.25, 0.5, 0.25],
    [0.25, 0.0, 0.25, 0.5],
]


def _bad_cases() -> list[tuple[str, dict[str, Any], str]]:
    cases: list[tuple[str, dict[str, Any], str]] = []

    def case(label: str, data: dict[str, Any], match: str) -> None:
        cases.append((label, data, match))

    case("missing peers", {k: v for k, v in ring().items() if k != "peers"} | {"edges": []}, "no peers")
    case("empty peers", ring(peers=[], edges=[]), "no peers")
    d = ring()
    d["peers"][2]["id"] = "p1"
    d["edges"] = [["p0", "p1"], ["p1", "p3"], ["p3", "p0"]]
    case("duplicate id", d, "duplicate peer id 'p1'")
    d = ring()
    d["peers"][3]["address"] = "127.0.0.1:50050"
    case("duplicate address", d, "duplicate address '127.0.0.1:50050'")
    for bad in ("127.0.0.1", "127.0.0.1:99999", "host:port", ":50050", "a b:1"):
        d = ring()
        d["peers"][1]["address"] = bad
        case(f"malformed address {bad}", d, f"peer 'p1': malformed address '{bad}'")
    d = ring()
    d["edges"][0] = ["p0", "p9"]
    case("unknown peer in edge", d, r"edge \[p0, p9\]: unknown peer 'p9'")
    d = ring()
    d["edges"].append(["p2", "p2"])
    case("self edge", d, r"edge \[p2, p2\]: self-edge")
    d = ring()
    d["edges"].append(["p1", "p0"])  # reverse of [p0, p1]: same undirected edge
    case("duplicate undirected edge", d, r"duplicate edge.*\[p1, p0\]")
    d = ring(directed=True, weights="uniform")
    d["edges"].append(["p0", "p1"])
    case("duplicate directed edge", d, r"duplicate edge: \[p0, p1\]")
    d = ring()
    d["edges"] = [["p0", "p1"], ["p2", "p3"]]
    case("disconnected", d, r"disconnected: 2 components, \{p0, p1\} and \{p2, p3\}")
    d = ring(directed=True, weights="uniform")
    d["edges"] = [["p0", "p1"], ["p1", "p2"], ["p2", "p3"]]  # a path, not a cycle
    case("not strongly connected", d, "not strongly connected: 'p1' cannot reach 'p0'")
    case("no edges no schedule", ring(edges=[]), "disconnected")
    case("metropolis on directed", ring(directed=True), "metropolis weights need an undirected graph")
    case("unknown weights", ring(weights="laplacian"), "unknown weights kind 'laplacian'")
    case("explicit without matrix", ring(weights="explicit"), "explicit needs a matrix")
    neg = copy.deepcopy(GOOD_RING4)
    neg[0] = [1.25, -0.25, 0.0, 0.0]
    case("negative weight", ring(weights=explicit(neg)), "row p0, column p1: negative weight -0.25")
    rows = copy.deepcopy(GOOD_RING4)
    rows[2] = [0.0, 0.25, 0.4, 0.25]
    case("row sum", ring(weights=explicit(rows)), "row p2 sums to 0.9")
    asym = [[0.5, 0.5, 0, 0], [0.25, 0.5, 0.25, 0], [0, 0.25, 0.5, 0.25], [0.25, 0, 0.25, 0.5]]
    case("asymmetric on undirected", ring(weights=explicit(asym)), "must be symmetric: row p0, column p1")
    nonedge = copy.deepcopy(GOOD_RING4)
    nonedge[0] = [0.25, 0.25, 0.25, 0.25]
    case("non-edge", ring(weights=explicit(nonedge)), r"row p0, column p2: weight 0.25 on a non-edge")
    case("unknown matrix peer", ring(weights=explicit({"p7": {"p0": 1.0}})), "unknown peer 'p7'")
    case(
        "k zero",
        ring(edges=[], weights="uniform", schedule={"kind": "random_pull", "k": 0}),
        "k=0 must be at least 1",
    )
    case(
        "k = n",
        ring(edges=[], weights="uniform", schedule={"kind": "random_pull", "k": 4}),
        "k=4 must be less than",
    )
    case(
        "k > degree",
        ring(weights="uniform", schedule={"kind": "random_pull", "k": 3}),
        "peer 'p0' has only 2 candidate",
    )
    case(
        "unknown schedule",
        ring(weights="uniform", schedule={"kind": "gossip", "k": 1}),
        "unknown kind 'gossip'",
    )
    case("unknown top key", ring(edge=[]), "edge: unknown key; allowed: .*did you mean 'edges'")
    d = ring()
    d["peers"][0]["port"] = 1
    case("unknown peer key", d, r"peers\[0\].port: unknown key; allowed: id, address")
    case(
        "unknown schedule key",
        ring(weights="uniform", schedule={"kind": "random_pull", "k": 1, "n": 2}),
        "schedule.n: unknown key; allowed: kind, k",
    )
    d = ring()
    d["peers"][0]["id"] = 7
    case("non-string id", d, r"peers\[0\].id: must be a string, got 7")
    case(
        "explicit with schedule",
        ring(weights=explicit(GOOD_RING4), schedule={"kind": "random_pull", "k": 1}),
        "cannot be combined with a random schedule",
    )
    return cases


BAD_CASES = _bad_cases()


@pytest.mark.parametrize(("data", "match"), [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_bad_topologies_raise_named_errors(data: dict[str, Any], match: str) -> None:
    before = copy.deepcopy(data)
    with pytest.raises(TopologyError, match=match) as info:
        parse_topology(data, source="bad.yaml")
    assert str(info.value).startswith("bad.yaml: ")
    assert data == before  # parsing never mutates its input


def test_valid_base_case_and_explicit_forms_parse() -> None:
    """Guards the bad cases: each differs from a valid file only by the broken item."""
    t = parse_topology(ring())
    assert t.ids == ("p0", "p1", "p2", "p3")
    as_rows = parse_topology(ring(weights=explicit(GOOD_RING4)))
    as_map = parse_topology(
        ring(
            weights={
                "kind": "explicit",
                "matrix": {
                    "p0": {"p0": "1/2", "p1": "1/4", "p3": 0.25},
                    "p1": {"p0": 0.25, "p1": 0.5, "p2": 0.25},
                    "p2": {"p1": 0.25, "p2": 0.5, "p3": 0.25},
                    "p3": {"p0": 0.25, "p2": 0.25, "p3": 0.5},
                },
            }
        )
    )
    np.testing.assert_array_equal(as_rows.mixing_matrix(), np.array(GOOD_RING4))
    np.testing.assert_array_equal(as_map.mixing_matrix(), np.array(GOOD_RING4))
    assert as_rows.hash() == as_map.hash()


@pytest.mark.parametrize(
    ("label", "text", "match"),
    [
        ("yaml syntax", "peers: [\n", "invalid YAML"),
        ("duplicate key", "name: a\nname: b\npeers: []\n", "duplicate key 'name'"),
        ("not a mapping", "- 1\n- 2\n", "a topology file is a mapping"),
    ],
)
def test_check_exits_2_with_reason(tmp_path: Path, label: str, text: str, match: str) -> None:
    f = tmp_path / "t.yaml"
    f.write_text(text)
    with pytest.raises(TopologyError, match=match):
        load_topology(f)
    res = CliRunner().invoke(app, ["check", str(f)])
    assert res.exit_code == 2  # bad input
    assert "error: " in res.output and match in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize(
    ("data", "match"), [c[1:] for c in BAD_CASES[:12]], ids=[c[0] for c in BAD_CASES[:12]]
)
def test_check_cli_reports_validation_errors(tmp_path: Path, data: dict[str, Any], match: str) -> None:
    import yaml

    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["check", str(f)])
    assert res.exit_code == 2, res.output  # bad input
    assert "error: " in res.output
    import re

    assert re.search(match, res.output), res.output


def test_check_missing_file() -> None:
    res = CliRunner().invoke(app, ["check", "/nonexistent/topology.yaml"])
    assert res.exit_code == 2 and "topology file not found" in res.output


# ---- mixing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "topo",
    [
        generate("ring", 7),
        generate("grid", 12),
        generate("torus", 16),
        generate("exponential", 10),
        generate("random_regular", 12, k=3, seed=5),
        # an irregular graph: metropolis must still be doubly stochastic, uniform not
        parse_topology(ring(5, edges=[["p0", "p1"], ["p1", "p2"], ["p2", "p3"], ["p3", "p4"], ["p0", "p2"]])),
    ],
    ids=lambda t: t.name,
)
def test_metropolis_is_symmetric_doubly_stochastic(topo: Topology) -> None:
    w = topo.mixing_matrix()
    np.testing.assert_allclose(w, w.T, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
    assert (w >= 0).all()
    # Off-diagonal support is exactly the edge set.
    g = topo.graph()
    for i, a in enumerate(topo.ids):
        for j, b in enumerate(topo.ids):
            if i != j:
                assert (w[i, j] > 0) == g.has_edge(a, b)
                if g.has_edge(a, b):
                    assert w[i, j] == pytest.approx(1 / (1 + max(g.degree(a), g.degree(b))))


def test_uniform_rows_and_push_columns() -> None:
    irregular = ring(
        5, edges=[["p0", "p1"], ["p1", "p2"], ["p2", "p3"], ["p3", "p4"], ["p0", "p2"]], weights="uniform"
    )
    t = parse_topology(irregular)
    w = t.mixing_matrix()
    np.testing.assert_allclose(w.sum(axis=1), 1.0)
    assert w[0, 0] == pytest.approx(1 / 3) and w[2, 2] == pytest.approx(1 / 4)
    assert not np.allclose(w.sum(axis=0), 1.0)  # not doubly stochastic on an irregular graph
    push = t.mixing_matrix(mode="push")
    np.testing.assert_allclose(push.sum(axis=0), 1.0)
    d = parse_topology(
        {
            "peers": ring(3)["peers"],
            "directed": True,
            "edges": [["p0", "p1"], ["p1", "p2"], ["p2", "p0"], ["p0", "p2"]],
        }
    )
    assert d.weights == "uniform"
    pull, push = d.mixing_matrix(), d.mixing_matrix(mode="push")
    np.testing.assert_allclose(pull.sum(axis=1), 1.0)
    np.testing.assert_allclose(push.sum(axis=0), 1.0)
    # p0 pushes to p1 and p2 and keeps a third; p2 pulls from p1 and p0.
    assert push[:, 0].tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3])
    assert pull[2].tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3])
    assert pull[1].tolist() == pytest.approx([0.5, 0.5, 0.0])
    with pytest.raises(ValueError, match="unknown mixing mode"):
        d.mixing_matrix(mode="gossip")


def test_explicit_push_requires_column_stochastic() -> None:
    t = parse_topology(ring(weights=explicit(GOOD_RING4)))
    np.testing.assert_array_equal(t.mixing_matrix(mode="push"), np.array(GOOD_RING4))
    d = parse_topology(
        {
            "peers": ring(3)["peers"],
            "directed": True,
            "edges": [["p0", "p1"], ["p1", "p2"], ["p2", "p0"], ["p0", "p2"]],
            "weights": explicit([[1, 0, 0], [0.5, 0.5, 0], [0.25, 0.25, 0.5]]),
        }
    )
    with pytest.raises(TopologyError, match="not column-stochastic"):
        d.mixing_matrix(mode="push")


@pytest.mark.parametrize("n", [4, 5, 8, 16, 100])
def test_ring_spectral_gap_closed_form(n: int) -> None:
    w = generate("ring", n, weights="uniform").mixing_matrix()
    assert w[0, 0] == pytest.approx(1 / 3)
    expected = 1 - (1 / 3 + 2 / 3 * math.cos(2 * math.pi / n))
    assert spectral_gap(w) == pytest.approx(expected, abs=1e-10)
    assert spectral_gap(generate("ring", n).mixing_matrix()) == pytest.approx(expected, abs=1e-10)


def test_spectral_gap_full_and_edge_cases() -> None:
    for n in (2, 5, 10):
        assert spectral_gap(generate("full", n, weights="uniform").mixing_matrix()) == pytest.approx(
            1.0, abs=1e-10
        )
    assert spectral_gap(np.eye(3)) == pytest.approx(0.0)  # no mixing at all: no gap
    assert spectral_gap(np.ones((1, 1))) == 1.0
    # Non-symmetric: a directed ring with self weight 1/2 has eigenvalues 1/2 + 1/2 e^{2 pi i k / n}.
    w = generate("directed_ring", 6).mixing_matrix()
    assert spectral_gap(w) == pytest.approx(1 - abs(0.5 + 0.5 * np.exp(2j * np.pi / 6)))


# ---- random schedule ----------------------------------------------------------------------------


def test_random_pull_plans() -> None:
    t = generate("random_pull", 12, k=4)
    ids = t.ids
    for rnd in range(3):
        w = t.mixing_matrix(round=rnd, seed=7)
        np.testing.assert_allclose(w.sum(axis=1), 1.0)
        plans = {p: t.plan(p, round=rnd, seed=7) for p in ids}
        for i, p in enumerate(ids):
            plan = plans[p]
            assert isinstance(plan, MixingPlan) and plan.mode == "pull" and plan.round == rnd
            assert len(plan.in_weights) == 4 and p not in plan.in_weights
            assert list(plan.in_weights.values()) == pytest.approx([1 / 5] * 4)
            assert plan.self_weight == pytest.approx(1 / 5)
            row = {ids[j]: w[i, j] for j in range(len(ids)) if j != i and w[i, j] > 0}
            assert plan.in_weights == row
            for k, wk in plan.out_weights.items():  # i's out_weights agree with k's in_weights
                assert plans[k].in_weights[p] == wk
            for j, wj in plan.in_weights.items():
                assert plans[j].out_weights[p] == wj
    # deterministic from (seed, round, step): a fresh, equal topology computes the same plans
    again = generate("random_pull", 12, k=4)
    assert again.plan("p3", round=2, seed=7) == t.plan("p3", round=2, seed=7)
    np.testing.assert_array_equal(again.mixing_matrix(5, 1, 7), t.mixing_matrix(5, 1, 7))
    # fresh per round, per step and per seed
    base = t.mixing_matrix(round=0, seed=7)
    assert not np.array_equal(base, t.mixing_matrix(round=1, seed=7))
    assert not np.array_equal(base, t.mixing_matrix(round=0, step=1, seed=7))
    assert not np.array_equal(base, t.mixing_matrix(round=0, seed=8))
    assert t.possible_in_neighbours("p0") == frozenset(ids[1:])
    assert t.possible_out_neighbours("p0") == frozenset(ids[1:])


def test_random_pull_push_mode_and_static_candidates() -> None:
    t = generate("random_pull", 8, k=3)
    push = t.mixing_matrix(round=4, seed=1, mode="push")
    np.testing.assert_allclose(push.sum(axis=0), 1.0)
    plans = {p: t.plan(p, round=4, seed=1, mode="push") for p in t.ids}
    for p, plan in plans.items():
        assert len(plan.out_weights) == 3
        for k, wk in plan.out_weights.items():
            assert plans[k].in_weights[p] == wk == pytest.approx(1 / 4)
    # With static edges, draws are restricted to them.
    g = generate("torus", 16)
    data = g.to_dict() | {"weights": "uniform", "schedule": {"kind": "random_pull", "k": 2}}
    s = parse_topology(data)
    for rnd in range(5):
        for p in s.ids:
            plan = s.plan(p, round=rnd)
            assert set(plan.in_weights) <= g.possible_in_neighbours(p)
    assert s.possible_in_neighbours("p5") == g.possible_in_neighbours("p5")
    assert len(s.possible_in_neighbours("p5")) == 4


def test_static_plans_and_neighbours() -> None:
    t = load_topology(ROOT / "topology" / "directed-ring-4.yaml")
    plan = t.plan("p1", round=3)
    assert plan.in_weights == {"p0": 0.5} and plan.out_weights == {"p2": 0.5} and plan.self_weight == 0.5
    assert t.plan("p1", round=9, seed=3) == MixingPlan("p1", 9, 0, "pull", 0.5, {"p0": 0.5}, {"p2": 0.5})
    assert t.possible_in_neighbours("p1") == {"p0"} and t.possible_out_neighbours("p1") == {"p2"}
    r = generate("ring", 6)
    assert r.possible_in_neighbours("p0") == {"p1", "p5"} == r.possible_out_neighbours("p0")
    with pytest.raises(KeyError, match="unknown peer 'zz'"):
        r.plan("zz", 0)
    with pytest.raises(ValueError, match="round must be a non-negative integer"):
        r.plan("p0", -1)
    m = r.mixing_matrix()
    m[0, 0] = 99.0  # callers get a copy, never the cached matrix
    assert r.mixing_matrix()[0, 0] == pytest.approx(1 / 3)


# ---- hash, serialization, generators ------------------------------------------------------------


def test_hash_stable_and_sensitive() -> None:
    a = parse_topology(ring(6))
    assert a.hash() == parse_topology(ring(6)).hash()
    assert len(a.hash()) == 16 and int(a.hash(), 16) >= 0
    assert a.hash() == parse_topology(ring(6, name="other")).hash()  # name is cosmetic
    reordered = ring(6)
    reordered["edges"] = [list(reversed(e)) for e in reversed(reordered["edges"])]
    assert parse_topology(reordered).hash() == a.hash()  # same undirected graph
    changed = ring(6)
    changed["edges"][0] = ["p0", "p2"]
    changed["edges"].append(["p0", "p1"])
    changed["edges"].remove(["p1", "p2"])
    changed["edges"].append(["p1", "p3"])
    assert parse_topology(changed).hash() != a.hash()
    assert parse_topology(ring(6, weights="uniform")).hash() != a.hash()
    moved = ring(6)
    moved["peers"][0]["address"] = "10.0.0.1:50050"
    assert parse_topology(moved).hash() == a.hash()  # where a peer runs is the address book's business
    renamed = ring(6)
    renamed["peers"][0]["id"] = "q0"
    renamed["edges"] = [[x if x != "p0" else "q0" for x in e] for e in renamed["edges"]]
    assert parse_topology(renamed).hash() != a.hash()  # ids are part of the graph
    assert generate("random_pull", 8, k=3).hash() != generate("random_pull", 8, k=2).hash()
    # Pinned: the canonical form must not drift between releases (peers on another version would refuse us).
    assert generate("ring", 4).hash() == "ef288926246afe73"


ALL_KINDS = [
    ("ring", 5, {}),
    ("grid", 6, {}),
    ("torus", 9, {}),
    ("exponential", 9, {}),
    ("full", 5, {}),
    ("random_regular", 10, {"k": 4, "seed": 3}),
    ("random_pull", 6, {"k": 2}),
    ("directed_ring", 5, {}),
    ("erdos_renyi", 12, {"p": 0.3, "seed": 2}),
]


@pytest.mark.parametrize(("kind", "n", "kw"), ALL_KINDS, ids=[k[0] for k in ALL_KINDS])
def test_generators_validate_and_round_trip(tmp_path: Path, kind: str, n: int, kw: dict[str, Any]) -> None:
    t = generate(kind, n, **kw)
    assert t.ids == tuple(f"p{i}" for i in range(n))
    assert t.address("p2") == "127.0.0.1:50052"
    f = tmp_path / "t.yaml"
    t.dump(f)
    back = load_topology(f)
    assert back == t and back.hash() == t.hash()
    assert parse_topology(t.to_dict()) == t
    w = t.mixing_matrix(round=1)
    np.testing.assert_allclose(w.sum(axis=1), 1.0)


def test_generator_shapes_and_options() -> None:
    assert len(generate("grid", 12).edges) == 17  # 3 x 4 grid
    assert {d for _, d in generate("torus", 16).graph().degree} == {4}
    assert {d for _, d in generate("exponential", 16).graph().degree} == {7}  # +-1, +-2, +-4, 8
    rr = generate("random_regular", 20, k=3, seed=1)
    assert {d for _, d in rr.graph().degree} == {3}
    assert rr == generate("random_regular", 20, k=3, seed=1)
    assert rr.edges != generate("random_regular", 20, k=3, seed=2).edges
    t = generate("ring", 3, address_template="peer-{i}:50051")
    assert [p.address for p in t.peers] == ["peer-0:50051", "peer-1:50051", "peer-2:50051"]
    with pytest.raises(TopologyError, match="does not factor"):
        generate("grid", 7)
    with pytest.raises(TopologyError, match="needs k"):
        generate("random_regular", 8)
    with pytest.raises(TopologyError, match="metropolis weights need an undirected graph"):
        generate("directed_ring", 4, weights="metropolis")
    with pytest.raises(TopologyError, match="unknown topology kind"):
        generate("star", 4)


def test_erdos_renyi_is_the_first_connected_draw_from_its_seed_on() -> None:
    import networkx as nx

    n, p = 20, 0.12  # sparse enough that many draws are disconnected
    draws = [nx.is_connected(nx.gnp_random_graph(n, p, seed=s)) for s in range(40)]
    start = draws.index(False)  # a seed whose own draw is disconnected
    first = next(s for s in range(start, 40) if draws[s])
    t = generate("erdos_renyi", n, p=p, seed=start)
    assert nx.is_connected(t.graph()) and t.weights == "metropolis"
    want = nx.gnp_random_graph(n, p, seed=first)  # the next connected seed's graph, edge for edge
    assert sorted(t.edges) == sorted((f"p{min(a, b)}", f"p{max(a, b)}") for a, b in want.edges)
    assert generate("erdos_renyi", n, p=p, seed=start) == t  # deterministic
    assert generate("erdos_renyi", n, p=p, seed=first + 1).edges != t.edges
    assert len(generate("erdos_renyi", 6, p=1.0).edges) == 15  # p = 1: the complete graph
    for bad in (0, -0.1, 1.5, float("nan"), True):
        with pytest.raises(TopologyError, match="must be a probability"):
            generate("erdos_renyi", 8, p=bad)
    with pytest.raises(TopologyError, match="needs p"):
        generate("erdos_renyi", 8)
    with pytest.raises(TopologyError, match="p is only used by erdos_renyi"):
        generate("ring", 8, p=0.5)
    with pytest.raises(TopologyError, match="no connected"):
        generate("erdos_renyi", 200, p=0.001)


def test_the_authors_random_graph_file_is_the_generators() -> None:
    """topology/er-128-p0.25.yaml: DePRL's public code's Random graph, G(128, 0.25), with its uniform weights."""
    t = load_topology(ROOT / "topology" / "er-128-p0.25.yaml")
    assert t == generate("erdos_renyi", 128, p=0.25, seed=0, weights="uniform", name="er-128-p0.25")
    w = t.mixing_matrix()
    deg = np.array([d for _, d in sorted(t.graph().degree, key=lambda nd: int(nd[0][1:]))])
    np.testing.assert_allclose(np.diag(w), 1.0 / (deg + 1))  # self and every neighbour alike
    assert 28 < deg.mean() < 36  # about 0.25 x 127 neighbours


def test_explicit_round_trip(tmp_path: Path) -> None:
    t = parse_topology(ring(weights=explicit(GOOD_RING4)))
    t.dump(tmp_path / "e.yaml")
    assert load_topology(tmp_path / "e.yaml") == t


GENERATED_EXAMPLES = {
    "ring-4.yaml": ("ring", 4, None),
    "ring-8.yaml": ("ring", 8, None),
    "grid-9.yaml": ("grid", 9, None),
    "torus-16.yaml": ("torus", 16, None),
    "exponential-8.yaml": ("exponential", 8, None),
    "full-8.yaml": ("full", 8, None),
    "random-pull-8.yaml": ("random_pull", 8, 3),
    "directed-ring-4.yaml": ("directed_ring", 4, None),
}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_files_are_valid(path: Path) -> None:
    """Every file under topology/ (including ones other tools write there) loads and checks."""
    t = load_topology(path)
    res = CliRunner().invoke(app, ["check", str(path)])
    assert res.exit_code == 0, res.output
    assert "spectral gap" in res.output and t.hash() in res.output


@pytest.mark.parametrize("name", sorted(GENERATED_EXAMPLES))
def test_example_files_match_generator(name: str) -> None:
    kind, n, k = GENERATED_EXAMPLES[name]
    assert load_topology(ROOT / "topology" / name) == generate(kind, n, k=k)


# ---- CLI ----------------------------------------------------------------------------------------


def test_cli_gen_check_show(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["gen", "ring", "--peers", "6"])
    assert res.exit_code == 0, res.output
    import yaml

    assert parse_topology(yaml.safe_load(res.stdout)) == generate("ring", 6)
    out = tmp_path / "rp.yaml"
    res = runner.invoke(
        app, ["gen", "random_pull", "--peers", "8", "--k", "3", "--base-port", "6000", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    t = load_topology(out)
    assert t.address("p1") == "127.0.0.1:6001" and t.schedule is not None and t.schedule.k == 3
    r0 = runner.invoke(app, ["check", str(out), "--round", "0"])
    r1 = runner.invoke(app, ["check", str(out), "--round", "1"])
    assert r0.exit_code == r1.exit_code == 0
    gap0 = f"{spectral_gap(t.mixing_matrix(round=0)):.6g}"
    assert gap0 in r0.output and "doubly stochastic: no" in r0.output
    assert r0.output != r1.output
    ring_check = runner.invoke(app, ["check", str(ROOT / "topology" / "ring-8.yaml")])
    assert "doubly stochastic: yes" in ring_check.output and "edges: 8" in ring_check.output
    bad = runner.invoke(app, ["gen", "grid", "--peers", "7"])
    assert bad.exit_code == 2 and "error: " in bad.output
    er = runner.invoke(app, ["gen", "erdos_renyi", "--peers", "10", "--p", "0.4", "--seed", "3"])
    assert er.exit_code == 0, er.output
    assert parse_topology(yaml.safe_load(er.stdout)) == generate("erdos_renyi", 10, p=0.4, seed=3)
    bad_p = runner.invoke(app, ["gen", "erdos_renyi", "--peers", "10", "--p", "2"])
    assert bad_p.exit_code == 2 and "error: erdos_renyi: p=2.0 must be a probability" in bad_p.output
    png = tmp_path / "ring.png"
    res = runner.invoke(app, ["show", str(ROOT / "topology" / "ring-8.yaml"), "--out", str(png)])
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
