"""Resuming an interrupted simulation from the last round that every peer checkpointed.

A Node overwrites ``checkpoints/<peer>.npz`` every ``checkpoint.every`` rounds. The peers of one
simulation are not in lock-step (a peer can finish round r while a peer two hops away still
trains r - 1), so after a crash the latest files can hold different rounds, and peers cannot
restart from different rounds (each waits for its neighbours' payload of its own round). So the
simulation also keeps each checkpoint as a *generation* ``checkpoints/gen/<peer>.r<R>.npz`` (a
hard link to the file the Node just wrote atomically: no copy), the last :data:`GENERATIONS` of
them per peer. Resuming picks the highest R that every peer has, puts those files back as the
peers' checkpoints and cuts ``metrics.jsonl`` to the rounds before R; the run then continues
exactly as if it had not stopped (checkpoints hold parameters, algorithm state and the peer's
RNG state). A finished run drops its generations and keeps the final checkpoints.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from p2pfl.algorithms.base import PeerState
from p2pfl.badinput import BadInput, shorten
from p2pfl.checkpoint import (
    CheckpointError,
    Verified,
    changed_keys,
    checkpoint_info,
    save_checkpoint,
    verify_checkpoint,
)
from p2pfl.runfolder import config_change_entry, keep_rounds, record_config_change
from p2pfl.storage import retrying

#: Checkpoint generations kept per peer (peers drift apart by far less than two checkpoint intervals).
GENERATIONS = 3


def _gen_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints" / "gen"


def _parse(name: str) -> tuple[str, int] | None:
    """``<peer>.r<R>.npz`` -> (peer, R)."""
    peer, sep, r = name.removesuffix(".npz").rpartition(".r")
    return (peer, int(r)) if name.endswith(".npz") and sep and r.isdigit() else None


def _generations(gen: Path) -> dict[int, set[str]]:
    """round -> the peers holding a generation of that round."""
    out: dict[int, set[str]] = {}
    for parsed in (_parse(f.name) for f in (gen.iterdir() if gen.is_dir() else ())):
        if parsed is not None:
            out.setdefault(parsed[1], set()).add(parsed[0])
    return out


def keep_generation(node: Any, every: int) -> Callable[[int], None] | None:
    """A Node ``on_round`` hook that links each fresh checkpoint into ``checkpoints/gen/``.

    Wraps the node's existing hook (kept, called after). The Node saves its checkpoint before it
    calls ``on_round``, on the same rounds this hook recognizes.
    """
    ckpt: Path | None = node.checkpoint_path
    previous = node.on_round
    if ckpt is None or not every:
        return previous

    # This peer's generations (round, path), listed from the folder once (a resumed run has some),
    # then kept here: listing the folder of all peers' generations at every checkpoint made the
    # checkpoint rounds quadratic in the number of peers.
    mine: list[tuple[int, Path]] | None = None

    def on_round(r: int) -> None:
        nonlocal mine
        done = r + 1
        if checkpoint_due(done, every, node.rounds):
            if mine is None:
                gen = ckpt.parent / "gen"
                gen.mkdir(parents=True, exist_ok=True)
                mine = sorted((p[1], f) for f in gen.iterdir() if (p := _parse(f.name)) and p[0] == node.peer_id)
            target = link_generation(ckpt, node.peer_id, done)
            mine = sorted({**dict(mine), done: target}.items())
            for _, old in mine[:-GENERATIONS]:
                old.unlink(missing_ok=True)
            mine = mine[-GENERATIONS:]
        if previous is not None:
            previous(r)

    return on_round


def link_generation(ckpt: Path, peer: str, done: int) -> Path:
    """Keep the checkpoint a writer has just replaced atomically as generation ``<peer>.r<done>``: a
    hard link, no copy (the next atomic write replaces the checkpoint's name, not the linked file)."""
    gen = ckpt.parent / "gen"
    target = gen / f"{peer}.r{done}.npz"

    def link() -> None:
        gen.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        os.link(ckpt, target)

    retrying(target, link, "link")  # a storage fault is retried, then StorageError (p2pfl.storage)
    return target


def keep_generations(ckpt_dir: Path, peers: list[str], done: int) -> None:
    """For a writer of every peer's checkpoint at once (the batched engine): link each peer's fresh
    checkpoint as its generation of round ``done``, then keep the newest :data:`GENERATIONS` rounds
    (one listing of the folder per checkpoint round, not one per peer)."""
    for pid in peers:
        link_generation(Path(ckpt_dir) / f"{pid}.npz", pid, done)
    gen = Path(ckpt_dir) / "gen"
    old = set(sorted(_generations(gen))[:-GENERATIONS])
    for f in gen.iterdir():
        if (parsed := _parse(f.name)) and parsed[1] in old:
            f.unlink(missing_ok=True)


def checkpoint_due(done: int, every: int, rounds: int) -> bool:
    """Whether a writer checkpoints after ``done`` rounds: every ``every`` (0: never) and the last."""
    return bool(every) and (done % every == 0 or done == rounds)


def save_generation(run_dir: Path, state: PeerState, generator: torch.Generator, every: int, rounds: int) -> None:
    """For a writer without a Node (a Flower node, the Flower server): on the checkpoint rounds
    (every ``every``, and the last of ``rounds``), ``state`` as generation ``<peer>.r<round>``,
    keeping the newest :data:`GENERATIONS` of that peer (the Node's hook keeps its own list)."""
    done, peer = state.round, state.peer_id
    if not checkpoint_due(done, every, rounds):
        return
    gen = _gen_dir(run_dir)
    save_checkpoint(gen / f"{peer}.r{done}.npz", state, generator)
    mine = sorted((p[1], f) for f in gen.glob(f"{peer}.r*.npz") if (p := _parse(f.name)) and p[0] == peer)
    for _, old in mine[:-GENERATIONS]:
        old.unlink(missing_ok=True)


class ResumeError(BadInput):
    """``--resume`` was given a folder it cannot continue (a finished run, at its rounds already)."""


def finished_round(run_dir: Path, peers: list[str] | None = None) -> int | None:
    """The round a finished simulation ended at, when its final checkpoints can continue it: a
    ``summary.json`` and every peer's ``checkpoints/<peer>.npz`` (``peers``; None: every such file
    there is) of one same round. None otherwise."""
    run_dir = Path(run_dir)
    ckpts = run_dir / "checkpoints"
    if not (run_dir / "summary.json").is_file():
        return None
    files = [ckpts / f"{pid}.npz" for pid in peers] if peers is not None else sorted(ckpts.glob("*.npz"))
    try:
        rounds = {checkpoint_info(f)[0] if f.is_file() else 0 for f in files}
    except (OSError, ValueError, KeyError):
        return None
    return rounds.pop() if len(rounds) == 1 and min(rounds) > 0 else None


#: The command-line flag that accepts a changed config on a resume (named in the refusal).
ACCEPT_FLAG = "--accept-config-change"


@dataclass(frozen=True)
class ConfigChange:
    """A resume under another config than the checkpoint's run, accepted with `ACCEPT_FLAG`."""

    old: dict[str, str]
    new: dict[str, str]
    changed: list[str]


class ResumeCheck:
    """What a resume verifies in each checkpoint it would restart from, before it touches any file.

    Why one object: `p2pfl node` checks its own checkpoint, ``simulate --resume`` every peer's, and
    both must refuse the same things the same way: a damaged file, another peer's, another model's
    shapes (`verify_checkpoint`), and a run with another config unless ``accept`` (then the change is
    kept in `changes`, and `record` writes it to the run folder once everything is verified).
    """

    def __init__(self, run_dir: Path, raw: Mapping[str, Any], fingerprint: dict[str, str],
                 shapes: Callable[[str], Mapping[str, tuple[int, ...]]], *, accept: bool = False) -> None:
        self.run_dir, self.raw, self.fingerprint, self.shapes, self.accept = Path(run_dir), raw, fingerprint, shapes, accept
        self.changes: dict[str, ConfigChange] = {}  # peer -> its accepted change

    @cached_property
    def _folder_config(self) -> dict[str, Any] | None:
        """The run folder's ``config.yaml`` (the config the checkpoints were written under), read once."""
        from p2pfl.yamlsafe import load_yaml_file

        try:
            loaded = load_yaml_file(self.run_dir / "config.yaml", "config")
        except (OSError, ValueError):
            return None
        return loaded if isinstance(loaded, dict) else None

    def __call__(self, path: Path, peer: str) -> Verified:
        """``path`` verified as ``peer``'s checkpoint of this run; `CheckpointError` otherwise."""
        got = verify_checkpoint(path, peer_id=peer, shapes=self.shapes(peer))
        if got.run is None or got.run == self.fingerprint:
            return got  # the same run, or a format-1 checkpoint (no fingerprint: docs/bad-input.md)
        old = self._folder_config
        changed = changed_keys(old, self.raw) if old is not None else []
        if got.run.get("topology") != self.fingerprint["topology"]:
            changed.append("topology (the graph)")
        if not self.accept:
            what = ", ".join(changed) if changed else "keys not known: the run folder's config.yaml already holds this one"
            raise CheckpointError(f"was written by this run under another config (changed: {shorten(what, 200)})",
                                  source=shorten(str(path), 200),
                                  hint=f"resume with the old config, or pass {ACCEPT_FLAG} to go on with this one "
                                       "(recorded in config-changes.jsonl)")
        self.changes[peer] = ConfigChange(dict(got.run), dict(self.fingerprint), changed)
        return got

    def record(self, round: int) -> None:
        """Write the accepted changes (one line per change) to the run folder's ``config-changes.jsonl``."""
        by_change: dict[tuple[str, str, tuple[str, ...]], list[str]] = {}
        for peer, ch in sorted(self.changes.items()):
            key = (_fp_text(ch.old), _fp_text(ch.new), tuple(ch.changed))
            by_change.setdefault(key, []).append(peer)
        for peers in by_change.values():
            ch = self.changes[peers[0]]
            record_config_change(self.run_dir, config_change_entry(peers, round, ch.old, ch.new, ch.changed))
        self.changes = {}


def _fp_text(d: Mapping[str, str]) -> str:
    """A fingerprint as one comparable string."""
    return ",".join(f"{k}={d[k]}" for k in sorted(d))


def prepare_resume(run_dir: Path, peers: list[str], before: int | None = None,
                   check: ResumeCheck | None = None) -> int:
    """Restore the last round every peer checkpointed (below ``before``); return it (0: start over).

    Puts each peer's generation of that round back as ``checkpoints/<peer>.npz`` and rewrites
    ``metrics.jsonl`` without the rounds from it on (they will be recorded again). With no common
    generation the old generations are removed and 0 is returned: the run starts from round 0.

    A *finished* run (``summary.json``) is never started over: with its final checkpoints and
    ``before`` (the config's rounds) above the round it ended at, it is extended from there (no
    algorithm is told the number of rounds, so this continues exactly as a longer run would, but for
    the evaluation every run makes at its last round); otherwise :class:`ResumeError`, with nothing
    changed.

    ``check``: every checkpoint it would restart from is verified first (`ResumeCheck`), so a bad
    one is refused with the folder as it was; accepted config changes are recorded after that.
    """
    run_dir = Path(run_dir)
    gen = _gen_dir(run_dir)
    common = [r for r, have in _generations(gen).items() if set(peers) <= have and (before is None or r < before)]
    if not common and (run_dir / "summary.json").is_file():
        return _extend(run_dir, peers, before, check)
    if not common:
        shutil.rmtree(gen, ignore_errors=True)
        return 0
    start = max(common)
    if check is not None:
        for pid in peers:
            check(gen / f"{pid}.r{start}.npz", pid)
        check.record(start)
    for pid in peers:
        ckpt = run_dir / "checkpoints" / f"{pid}.npz"
        tmp = ckpt.with_name(ckpt.name + ".resume")
        tmp.unlink(missing_ok=True)
        os.link(gen / f"{pid}.r{start}.npz", tmp)
        os.replace(tmp, ckpt)
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        keep_rounds(metrics, start)  # the one definition of "the records of the rounds before start"
    return start


def _extend(run_dir: Path, peers: list[str], before: int | None, check: ResumeCheck | None = None) -> int:
    """A finished run continued to ``before`` rounds from its final checkpoints (see prepare_resume)."""
    if check is not None:
        for pid in peers:
            if (f := run_dir / "checkpoints" / f"{pid}.npz").is_file():
                check(f, pid)
    done = finished_round(run_dir, peers)
    if done is None:
        raise ResumeError(f"{shorten(str(run_dir))} holds a finished run without final checkpoints of every peer to continue "
                          "from; nothing to resume", source="--resume",
                          hint="drop --resume to run it again from round 0")
    if before is not None and done >= before:
        raise ResumeError(f"{shorten(str(run_dir))} holds a run that finished its {done} rounds; nothing to resume",
                          source="--resume", hint=f"set rounds above {done} to extend it")
    if check is not None:
        check.record(done)
    # From here on the folder is an interrupted run resumable at ``done``: its generations first, then
    # no summary (a kill in between leaves a finished run, as before).
    for pid in peers:
        link_generation(run_dir / "checkpoints" / f"{pid}.npz", pid, done)
    (run_dir / "summary.json").unlink()
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        keep_rounds(metrics, done)
    return done


def drop_generations(run_dir: Path) -> None:
    """A finished run needs only its final checkpoints."""
    shutil.rmtree(_gen_dir(run_dir), ignore_errors=True)


def resumable(run_dir: Path, peers: list[str] | None = None) -> bool:
    """Whether ``run_dir`` holds a checkpoint generation (of every peer in ``peers``, if given)."""
    gens = _generations(_gen_dir(run_dir))
    if peers is None:
        return bool(gens)
    return any(set(peers) <= have for have in gens.values())


__all__ = ["ACCEPT_FLAG", "GENERATIONS", "ConfigChange", "ResumeCheck", "ResumeError", "checkpoint_due", "drop_generations", "finished_round", "keep_generation",
           "keep_generations", "link_generation", "prepare_resume", "resumable", "save_generation"]
