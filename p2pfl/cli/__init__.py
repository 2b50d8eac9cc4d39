"""The ``p2pfl`` command line, the top floor: every typer command lives in this package and nothing
below it imports typer (``p2pfl.cli.main`` holds the app and the core commands; the heavier ones
are mounted lazily from their own modules here)."""

from __future__ import annotations

from p2pfl.cli.main import _load, _mount, _setup_logging, app, default_run_dir, main, print_summary

__all__ = ["_load", "_mount", "_setup_logging", "app", "default_run_dir", "main", "print_summary"]
