"""Bounded YAML loading for every file a user hands us (configs, topologies, sweeps).

Plain ``yaml.safe_load`` trusts its input: an alias bomb (a few hundred bytes whose anchors
expand to billions of nodes) burns gigabytes the moment anything walks the result, deep nesting
overflows Python's stack inside the composer (``RecursionError``), a UTF-16 or Latin-1 file gives a
bare ``UnicodeDecodeError``, and duplicate keys silently keep the last value. This loader refuses
all of these before building anything large, each with one `BadInput` naming the file and line:

* size: the file is read only up to ``max_bytes``;
* encoding: UTF-8 only (a UTF-8 BOM is accepted); UTF-16/32 and invalid bytes are named as such;
* depth: nesting deeper than ``max_depth`` is refused while composing (before any recursion);
* aliases: at most ``max_aliases`` alias uses, and the document *with aliases expanded* may have
  at most ``max_nodes`` nodes (computed on the composed node graph, shared nodes counted once per
  use, without expanding anything), so a bomb is refused in milliseconds and kilobytes;
* duplicate mapping keys are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from p2pfl.badinput import BadInput

__all__ = ["YamlLimits", "load_yaml_file", "load_yaml_text"]


@dataclass(frozen=True)
class YamlLimits:
    max_bytes: int = 4 << 20
    max_depth: int = 64
    max_aliases: int = 1000
    max_nodes: int = 200_000


class _LimitError(Exception):
    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem = problem
        self.line = None if mark is None else mark.line + 1


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader with depth and alias limits while composing, and no duplicate keys."""

    limits: YamlLimits = YamlLimits()

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:  # noqa: D102 - PyYAML hook
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > self.limits.max_aliases:
                raise _LimitError(f"more than {self.limits.max_aliases} aliases (*name)", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > self.limits.max_depth:
                raise _LimitError(f"nesting deeper than {self.limits.max_depth} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _construct_strict_mapping(loader: _BoundedLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # unhashable key: construct_mapping reports it
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_BoundedLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_strict_mapping)

_CLoader = getattr(yaml, "CSafeLoader", None)
if _CLoader is not None:
    class _StrictCLoader(_CLoader):  # type: ignore[misc, valid-type]
        """libyaml's parser and composer (fast), our constructor rules (no duplicate keys)."""

    _StrictCLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_strict_mapping)


def _scan_events(text: str, limits: YamlLimits) -> int:
    """Depth and alias limits on libyaml's event stream, before anything is composed; returns the alias count."""
    depth = aliases = 0
    for ev in yaml.parse(text, Loader=_CLoader):
        if isinstance(ev, yaml.CollectionStartEvent):
            depth += 1
            if depth > limits.max_depth:
                raise _LimitError(f"nesting deeper than {limits.max_depth} levels", ev.start_mark)
        elif isinstance(ev, yaml.CollectionEndEvent):
            depth -= 1
        elif isinstance(ev, yaml.AliasEvent):
            aliases += 1
            if aliases > limits.max_aliases:
                raise _LimitError(f"more than {limits.max_aliases} aliases (*name)", ev.start_mark)
    return aliases


def _expanded_size(root: yaml.Node, limits: YamlLimits) -> None:
    """Refuse a node graph whose alias expansion is too large, too deep or cyclic (iteratively)."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        nid = id(node)
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [x for kv in node.value for x in kv]
        if done:
            on_path.discard(nid)
            size[nid] = 1 + sum(size[id(c)] for c in children)
            depth[nid] = 1 + max((depth[id(c)] for c in children), default=0)
            if size[nid] > limits.max_nodes:
                raise _LimitError(f"aliases expand to more than {limits.max_nodes} nodes (an alias bomb?)",
                                  node.start_mark)
            if depth[nid] > limits.max_depth:
                raise _LimitError(f"aliases expand to nesting deeper than {limits.max_depth} levels",
                                  node.start_mark)
            continue
        if nid in size:
            continue
        if nid in on_path:
            raise _LimitError("recursive alias (an anchor used inside itself)", node.start_mark)
        on_path.add(nid)
        stack.append((node, True))
        for c in children:
            if id(c) in on_path:
                raise _LimitError("recursive alias (an anchor used inside itself)", c.start_mark)
            if id(c) not in size:
                stack.append((c, False))


def _decode(raw: bytes, source: str) -> str:
    boms = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16",
            b"\xfe\xff": "UTF-16"}
    for bom, name in boms.items():
        if raw.startswith(bom):
            raise BadInput(f"encoding: the file is {name} (byte-order mark); save it as UTF-8", source=source)
    if b"\x00" in raw:
        line = raw[: raw.index(b"\x00")].count(b"\n") + 1
        raise BadInput("encoding: NUL bytes in the file (UTF-16 without a byte-order mark, or binary?); "
                       "save it as UTF-8 text", source=source, line=line)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise BadInput(f"encoding: byte 0x{raw[exc.start]:02x} is not valid UTF-8; save the file as UTF-8",
                       source=source, line=line) from None
    return text[1:] if text.startswith("\ufeff") else text


def load_yaml_text(text: str, source: str, limits: YamlLimits = YamlLimits()) -> Any:
    """Parse one YAML document within ``limits``; `BadInput` naming ``source`` and the line otherwise."""
    if _CLoader is not None:  # libyaml: a 20,000-peer topology parses in about a second, not ten
        loader: Any = None
        aliases = 1  # unknown until scanned
        try:
            aliases = _scan_events(text, limits)
        except _LimitError as exc:
            raise BadInput(f"refused: {exc.problem}", source=source, line=exc.line) from None
        except yaml.YAMLError as exc:
            # The libyaml that newer PyYAML wheels bundle (6.0.4 here) has a nesting limit of its own,
            # deeper than ours, which its scanner can hit before our count sees the 65th level (it
            # looks ahead in flow collections): the same refusal, in our words. Any other error is
            # reported with its line by the loader below.
            if "maximum nesting depth" in str(getattr(exc, "problem", "")):
                mark = exc.problem_mark or exc.context_mark  # type: ignore[attr-defined]
                raise BadInput(f"refused: nesting deeper than {limits.max_depth} levels", source=source,
                               line=None if mark is None else mark.line + 1) from None
        loader = _StrictCLoader(text)
    else:
        aliases = 1
        loader = type("_Loader", (_BoundedLoader,), {"limits": limits})(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if aliases:  # without aliases the node graph is a tree no larger than the (bounded) file
            _expanded_size(node, limits)
        return loader.construct_document(node)
    except _LimitError as exc:
        raise BadInput(f"refused: {exc.problem}", source=source, line=exc.line) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = " ".join(p for p in (exc.context, exc.problem) if p) or "invalid YAML"
        if exc.context_mark is not None and mark is not None and exc.context_mark.line != mark.line:
            what += f" (the construct began on line {exc.context_mark.line + 1})"
        raise BadInput(f"invalid YAML: {what}", source=source, line=None if mark is None else mark.line + 1) from None
    except yaml.YAMLError as exc:
        raise BadInput(f"invalid YAML: {exc}", source=source) from None
    except RecursionError:  # pragma: no cover - the depth limit comes first
        raise BadInput("refused: nesting too deep", source=source) from None
    finally:
        loader.dispose()


def load_yaml_file(path: str | Path, what: str = "file", limits: YamlLimits = YamlLimits()) -> Any:
    """Read and parse ``path`` within ``limits`` (size first, then encoding, then YAML)."""
    p = Path(path)
    source = str(p)
    try:
        with open(p, "rb") as f:  # in chunks: read(max_bytes) would allocate max_bytes up front
            chunks: list[bytes] = []
            size = 0
            while size <= limits.max_bytes and (chunk := f.read(1 << 20)):
                chunks.append(chunk)
                size += len(chunk)
            raw = b"".join(chunks)
    except FileNotFoundError:
        raise BadInput(f"{what} not found", source=source) from None
    except IsADirectoryError:
        raise BadInput(f"{what} is a directory, not a file", source=source) from None
    except OSError as exc:
        raise BadInput(f"cannot read {what}: {exc.strerror or exc}", source=source) from None
    if len(raw) > limits.max_bytes:
        raise BadInput(f"refused: larger than {limits.max_bytes} bytes", source=source)
    return load_yaml_text(_decode(raw, source), source, limits)
