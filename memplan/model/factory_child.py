"""The user's own factory (``pkg.module:callable``) runs in a child process, never in memplan's: its import and its
calls may loop, ignore signals, abort, call ``os._exit``, fork or start processes of their own, and none of that
may hang memplan, crash it, or end it with the factory's exit code (a ``memplan check`` that exits 0 would pass a
CI gate).

- ``run(task, payload, spec)`` starts ``python -m memplan.model.factory_child`` in a session of its own (its own
  process group), hands it the task through a private file and waits at most the time limit, measured from
  outside; then the whole process group is killed, so nothing the factory started is left running. What comes
  back is the child's answer, or one line saying how the child ended (its exit code or signal, or the limit).
- the child builds the inventory on the meta device (``inventory``) or traces the step under FakeTensorMode
  (``trace``), with the parent's ``sys.path``; its stdout and stderr never reach memplan's (a factory that prints
  cannot corrupt ``--json``); only the process that started as the child writes the answer (a factory that forks
  leaves one answer, not two).

``locate(spec)`` finds the factory module's file without importing anything (importlib's path finders, as an
import would search), for the cache key: an edit to the file makes a new trace.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError, MemplanError, ModelSourceError, SettingsError
from memplan.inputs import quote

#: the seconds a trace of the user's module may take beyond the factory's own limit (a real trace of a large
#: module takes tens of seconds here)
TRACE_SECONDS = 600.0
#: the seconds a child may take beyond the factory's limit before it is stopped from outside: its start (importing
#: torch takes about a second here); inside it, the factory's import and call stop at the limit itself (SIGALRM),
#: which names what was running; this outer limit stops a factory that ignores that signal
STARTUP_SECONDS = 10.0


def locate(spec: str) -> Path | None:
    """The source file of the factory's module, found as ``import`` would find it on ``sys.path`` but without
    running any of it (a package's ``__init__`` included); None where it has none (a namespace, a built-in)."""
    import importlib.machinery

    module_name = spec.partition(":")[0]
    path: list[str] | None = None
    found = None
    for i, part in enumerate(module_name.split(".")):
        name = ".".join(module_name.split(".")[:i + 1])
        try:
            found = importlib.machinery.PathFinder.find_spec(part if path is None else name, path)
        except (ImportError, ValueError, OSError):
            return None
        if found is None:
            return None
        path = list(found.submodule_search_locations or []) or None
        if path is None and i < len(module_name.split(".")) - 1:
            return None
    origin = getattr(found, "origin", None)
    return Path(origin) if origin and Path(origin).is_file() else None


def digest(spec: str) -> str:
    """sha256 of the factory module's file (16 hex digits), "unknown" where it cannot be read."""
    import hashlib

    p = locate(spec)
    if p is None:
        return "unknown"
    try:
        return hashlib.sha256(p.read_bytes()).hexdigest()[:16]
    except OSError:
        return "unknown"


def _limit() -> float:
    from memplan.model.meta_builder import _factory_timeout

    return _factory_timeout()


def run(task: str, payload: dict[str, Any], spec: str) -> Any:
    """``task`` ("inventory" or "trace") done by a child process for the factory ``spec``; its answer, or the
    MemplanError it raised, or one line saying how it ended."""
    limit = _limit() + STARTUP_SECONDS + (TRACE_SECONDS if task == "trace" else 0.0)
    with tempfile.TemporaryDirectory(prefix="memplan-factory-") as tmp:
        request, answer, log = Path(tmp) / "request", Path(tmp) / "answer", Path(tmp) / "log"
        request.write_bytes(pickle.dumps({"task": task, "payload": payload, "spec": spec, "sys_path": sys.path,
                                          "cwd": os.getcwd()}))
        env = dict(os.environ)
        env.pop("_MEMPLAN_COMPLETE", None)
        with open(log, "wb") as err:
            try:
                child = subprocess.Popen([sys.executable, "-m", "memplan.model.factory_child", str(request),
                                          str(answer)], stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                         start_new_session=True, env=env, close_fds=True)
            except OSError as exc:
                raise ModelSourceError(f"factory {quote(spec)}: cannot start a process for it ({exc})") from None
            try:
                code = child.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                _kill_group(child)
        if code is None:
            doing = "building the model" if task == "inventory" else "building and tracing the model"
            raise ModelSourceError(f"factory {quote(spec)} did not finish {doing} within {limit:g} s (its process "
                                   "and everything it started were stopped; MEMPLAN_FACTORY_TIMEOUT sets the limit)")
        got = None
        if answer.is_file():
            try:
                got = pickle.loads(answer.read_bytes())
            except Exception:  # noqa: BLE001 - a half-written answer: the child ended while writing it
                got = None
        if got is None:
            how = (f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
                   else f"exit code {code}")
            raise ModelSourceError(f"factory {quote(spec)} ended its process ({how}) before "
                                   + ("returning a module" if task == "inventory" else "its step was traced")
                                   + _last_line(log))
        if "error" in got:
            raise _ERRORS.get(got.get("kind", ""), MemplanError)(got["error"])
        return got["result"]


#: the error classes a child's answer names (what the same failure raises in process)
_ERRORS: dict[str, type[MemplanError]] = {"model": ModelSourceError, "config": ConfigError, "settings": SettingsError}


def _kill_group(child: subprocess.Popen) -> None:
    """Stop the child's whole process group (what the factory started with it); reap the child."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was sent
        pass


def _last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_bytes()[-4000:].decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return f"; its last words: {quote(lines[-1], 160)}" if lines else ""


def _answer(path: Path, value: dict[str, Any], owner: int) -> None:
    """Written only by the process that started as the child (not a fork the factory made), atomically."""
    if os.getpid() != owner:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(value))
    os.replace(tmp, path)


def _do(task: str, payload: dict[str, Any], spec: str) -> Any:
    if task == "inventory":
        from memplan.model.meta_builder import build_meta_from_factory

        return build_meta_from_factory(spec)
    if task == "trace":
        from memplan.activations.tracing import trace_profile

        return trace_profile(**payload)
    raise ValueError(f"unknown task {task!r}")


def main() -> None:  # pragma: no cover - runs in the child (tests/cli/test_user_modules.py drives it)
    owner = os.getpid()
    request, answer = Path(sys.argv[1]), Path(sys.argv[2])
    req = pickle.loads(request.read_bytes())
    sys.path[:] = req["sys_path"]
    try:
        os.chdir(req["cwd"])
    except OSError:
        pass
    try:
        value: dict[str, Any] = {"result": _do(req["task"], req["payload"], req["spec"])}
    except MemplanError as exc:
        kind = next((k for k, cls in _ERRORS.items() if type(exc) is cls), "input")
        value = {"error": str(exc), "kind": kind}
    except BaseException as exc:  # noqa: BLE001 - the user's code: anything, SystemExit included
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        value = {"error": f"factory {quote(req['spec'])}: {type(exc).__name__}: {first}", "kind": "model"}
    _answer(answer, value, owner)
    os._exit(0)  # no atexit handlers of the user's code, no interpreter teardown in a fork


if __name__ == "__main__":  # pragma: no cover
    main()
