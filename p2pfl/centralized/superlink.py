"""Flower's Simulation Runtime the way ``flwr run`` reaches it: a SuperLink started for one run.

Why: ``flwr.simulation.run_simulation`` (a Python call that ran the ServerApp in a thread of the
calling process) is deprecated: flwr 1.42 logs on every call that it "will be removed in a future
version of Flower. Please use `flwr run`". The current path is ``flwr run <app>`` against a SuperLink
in simulation mode: the SuperLink starts a ``flwr-simulation`` process that loads the Flower
App's ServerApp and ClientApp from the app's FAB (``[tool.flwr.app.components]`` in
pyproject.toml) and runs the ClientApps on Ray. ``p2pfl flower --runtime ray`` therefore runs the
baseline as this project's Flower App (``p2pfl/centralized/app.py``), the very run a user starts
with ``flwr run .``: one code path, one runtime label (``flwr-run``).

The SuperLink here is private to the run, not the shared background one ``flwr`` starts for a
``:local:`` connection (that one keeps running after the run, on fixed ports, under
``~/.flwr``): its own ``FLWR_HOME`` (a temporary folder that also holds the installed FAB),
free loopback ports, an explicit connection in that home's ``config.toml`` (``flwr`` never starts
a SuperLink for an explicit address), and its whole process group (``flwr-simulation`` and the
Ray processes it starts) stopped when the run ends, however it ends.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

#: the folder holding this project's pyproject.toml with ``[tool.flwr.app]`` (the Flower App)
APP_ROOT = Path(__file__).resolve().parents[2]
#: how long the SuperLink may take to answer its health check (its start imports all of flwr)
START_TIMEOUT_S = 120.0
RunValue = str | int | float | bool
#: a run that ended without error (flwr's ``Status.FINISHED``:``SubStatus.COMPLETED``, as ``flwr ls`` shows it)
FINISHED = "finished:completed"
#: how flwr announces a deprecated feature (``flwr.supercore.logger.warn_deprecated_feature``)
DEPRECATED = "DEPRECATED FEATURE"


class FlowerRunError(RuntimeError):
    """``flwr run`` did not finish its run: the SuperLink did not start, or the run failed."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _executable(name: str) -> str:
    """A Flower console script of this interpreter's environment (then PATH's)."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise FlowerRunError(f"`{name}` not found next to {sys.executable} nor on PATH (pip install flwr)")
    return found


def _toml_value(value: RunValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a TOML basic string


def _end_group(pgid: int, wait_s: float = 5.0) -> None:
    """SIGKILL process group ``pgid`` until no member is left (bounded by ``wait_s``).

    A member SIGKILLed a moment ago is still there until the kernel ends it and its parent reaps it;
    returning at once would leave the group alive for a caller that checks (or reuses its files).
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


class LocalSuperLink:
    """A ``flower-superlink --simulation`` for one run (module doc); a context manager.

    ``flwr_run`` submits the app and waits for its run to finish; leaving the context stops the
    SuperLink's process group (SIGTERM, then SIGKILL after ``stop_timeout_s``) and removes its home.
    """

    def __init__(self, *, verbose: bool = False, stop_timeout_s: float = 15.0) -> None:
        self.verbose = verbose
        self.stop_timeout_s = stop_timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="p2pfl-superlink-")
        self.home = Path(self._tmp.name)
        self.http_port, self.control_port = _free_port(), _free_port()
        self.log_path = self.home / "superlink.log"
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    # flwr-simulation is found on PATH by the SuperLink
                    "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LocalSuperLink:
        (self.home / "config.toml").write_text(
            '[superlink]\ndefault = "p2pfl"\n\n[superlink.p2pfl]\n'
            f'address = "127.0.0.1:{self.http_port}"\ninsecure = true\n')
        cmd = [_executable("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
               "--disable-runtime-dependency-installation",
               "--control-api-address", f"127.0.0.1:{self.control_port}",
               "--host", "127.0.0.1", "--port", str(self.http_port), "--log-file", str(self.log_path)]
        try:
            self._proc = subprocess.Popen(cmd, env=self.env, cwd=self.home, start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._wait_healthy()
            log.info("flower-superlink up on 127.0.0.1:%d (FLWR_HOME %s)", self.http_port, self.home)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        url = f"http://127.0.0.1:{self.http_port}/health"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise FlowerRunError(f"flower-superlink exited with code {self._proc.returncode}: "
                                     f"{self._log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:  # noqa: S310 (loopback, our own port)
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise FlowerRunError(f"flower-superlink did not answer {url} within {START_TIMEOUT_S:.0f} s: "
                             f"{self._log_tail()}")

    def _log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no SuperLink log)"

    def stop(self) -> None:
        """Stop the SuperLink and everything it started (its process group), then remove its home."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if proc is not None:  # what the SuperLink started outlives it in the group (flwr-simulation, Ray)
            _end_group(proc.pid)
        self._tmp.cleanup()

    def flwr_run(self, app_dir: Path, run_config: Mapping[str, RunValue], federation: Mapping[str, RunValue]) -> str:
        """``flwr run app_dir --stream`` on this SuperLink; returns its output (the run's logs).

        ``run_config`` overrides ``[tool.flwr.app.config]``; ``federation`` sets the simulation
        (``num-supernodes``, ``client-resources-num-cpus``, ``init-args-num-cpus``, ...). The output
        is echoed when ``verbose``; a deprecated Flower feature the run used (flwr logs "DEPRECATED
        FEATURE") is logged here as a warning either way, as flwr logs it in-process. Raises
        ``FlowerRunError`` unless the run finished successfully.
        """
        overrides = self.home / "run-config.toml"
        overrides.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in run_config.items()))
        cmd = [_executable("flwr"), "run", str(app_dir), "--stream", "--run-config", str(overrides),
               "--federation-config", " ".join(f"{k}={_toml_value(v)}" for k, v in federation.items())]
        lines: list[str] = []
        with subprocess.Popen(cmd, env=self.env, cwd=self.home, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace") as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if self.verbose:
                    sys.stdout.write(line)
                if DEPRECATED in line:
                    log.warning("Flower, in the run: %s", line.strip())
        out = "".join(lines)
        status = self._run_status()
        if proc.returncode != 0 or status != FINISHED:
            raise FlowerRunError(f"flwr run ended with exit code {proc.returncode}, run status {status!r}: "
                                 f"{out[-3000:] or self._log_tail()}")
        return out

    def _run_status(self) -> str:
        """The run's status as the SuperLink reports it (``flwr ls``): ``finished:completed`` on success."""
        res = subprocess.run([_executable("flwr"), "ls", "--format", "json"], env=self.env, cwd=self.home,
                             capture_output=True, text=True, timeout=60)
        try:
            runs = json.loads(res.stdout).get("runs", [])
        except ValueError:
            return f"unknown ({res.stdout[-300:]}{res.stderr[-300:]})"
        return str(runs[-1].get("status", "unknown")) if runs else "no run"
