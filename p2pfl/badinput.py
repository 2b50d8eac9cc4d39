"""One error style for bad user input: ``FILE: KEY (or line N): problem; allowed: ...``.

Every loader and validator that refuses something a user wrote (a config, a ``--set`` override,
a topology file, a hyperparameter, a command-line value) raises a `BadInput` (or a subclass such
as ``ConfigError`` / ``TopologyError``). The command line prints ``error: <str(exc)>`` on one line
and exits with status 2, without a traceback unless ``--debug``. Keeping the parts separate (not
a pre-formatted string) lets an outer layer add the file name or mark a key as coming from
``--set`` without re-parsing the message.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["EXIT_BAD_INPUT", "BadInput", "suggest"]

#: Exit status of every command for bad input (Unix convention for usage errors, as click uses).
EXIT_BAD_INPUT = 2

# An error message repeats user-supplied text (a key, a value): never an unbounded one.
_MAX_SHOWN = 120


def shorten(text: str, limit: int = _MAX_SHOWN) -> str:
    """``text`` cut to ``limit`` characters, one line (a value echoed in an error stays readable)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def suggest(word: object, choices: Iterable[str]) -> str | None:
    """The closest of ``choices`` to a misspelled ``word`` (difflib), or None."""
    if not isinstance(word, str):
        return None
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


class BadInput(ValueError):
    """Something the user wrote is wrong; ``str()`` is the one-line message the CLI prints.

    ``source``: the file (or ``--set``, or a command-line option) the input came from; ``key``: the
    dotted key, or ``line``: the 1-based line; ``problem``: what is wrong; ``allowed``: the values
    accepted; ``hint``: a suggestion (a close match, what to set instead).
    """

    def __init__(self, problem: str, *, source: str | None = None, key: str | None = None,
                 line: int | None = None, allowed: Iterable[object] | str | None = None,
                 hint: str | None = None) -> None:
        self.problem = " ".join(str(problem).split())
        self.source = source
        self.key = key
        self.line = line
        if allowed is not None and not isinstance(allowed, str):
            allowed = ", ".join(str(a) for a in allowed)
        self.allowed = allowed
        self.hint = hint
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = [p for p in (self.source, self.key, None if self.line is None else f"line {self.line}") if p]
        text = ": ".join([*parts, self.problem])
        if self.allowed:
            text += f"; allowed: {shorten(self.allowed, 400)}"
        if self.hint:
            text += f"; {self.hint}"
        return text

    def located(self, source: str | None = None, key_prefix: str | None = None) -> BadInput:
        """Fill in the file (if not yet known) and prefix the key; returns ``self`` for ``raise``."""
        if source and not self.source:
            self.source = source
        if key_prefix:
            self.key = f"{key_prefix}.{self.key}" if self.key else key_prefix
        self.args = (str(self),)
        return self
