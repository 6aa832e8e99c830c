"""What memplan reads from the user, read so that no input can hang it, exhaust the machine, or reach past what the
user named; every refusal is one line (a MemplanError, exit 2).

- ``read_text``: a regular file of bounded size, as UTF-8. The file is opened without blocking and checked on the
  open descriptor (a FIFO, a device such as /dev/zero, a directory or a socket is refused before a byte is read;
  a symlink to a regular file, as the Hugging Face cache holds, is fine).
- ``load_json`` / ``load_yaml``: JSON with bounded nesting and integers (Python refuses to convert integers over
  4,300 digits; memplan says so), YAML with PyYAML's safe loader (no Python tags) and its aliases bounded: the
  document, with every alias expanded, may hold at most ``MAX_YAML_NODES`` nodes nested at most
  ``MAX_NESTING`` deep (a 1.5 KB "billion laughs" file expands to a billion), and only text keys.
- ``quote``: a value for an error message, cut to a few dozen characters without expanding it.
- ``deadline``: user regular expressions (PEFT's target_modules and patterns) run under a time limit: Python's
  ``re`` engine backtracks (``(.|.)*Z`` doubles its time with each character), and its matching loop checks for
  signals, so SIGALRM stops it.
- ``write_atomic``: a file memplan writes (a plot, a cached profile) goes to a temporary file beside the target,
  then is renamed over it; a target that exists and is not a regular file (a FIFO, a device) is refused.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError, SettingsError

#: the largest text file memplan reads (config.json, ds_config, job files, adapter configs)
MAX_TEXT_BYTES = 16 << 20
#: how deep a JSON or YAML document may nest (real configs nest a few levels)
MAX_NESTING = 64
#: nodes a YAML document may hold with its aliases expanded (an Accelerate config holds a few dozen)
MAX_YAML_NODES = 100_000
#: Python's own limit on converting digits to an integer (sys.get_int_max_str_digits' default)
MAX_INT_DIGITS = 4300


def read_text(path: Any, what: str, limit: int = MAX_TEXT_BYTES) -> str:
    """The text of a regular file of at most ``limit`` bytes, as UTF-8, or a one-line SettingsError. The file is
    opened non-blocking and checked on its descriptor, so a FIFO (which blocks on open) or a device (which never
    ends) is refused before it is read; nothing of its content is echoed in an error."""
    p = Path(path)
    check_regular(p, what)  # a FIFO or a device is refused before anything opens it
    try:
        # and checked again on the descriptor (the name may change between the two): opened non-blocking, so even
        # a FIFO put there meanwhile cannot block the open
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise SettingsError(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SettingsError(f"{what} {p} is not a regular file")
        if st.st_size > limit:
            raise SettingsError(f"{what} {p} is {st.st_size:,} bytes, more than the {limit:,}-byte limit")
        chunks, got = [], 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as exc:
        raise SettingsError(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if got > limit:  # grew while being read
        raise SettingsError(f"{what} {p} is more than the {limit:,}-byte limit")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise SettingsError(f"{what} {p} is not UTF-8 text") from None


def check_regular(path: Any, what: str) -> Path:
    """``path`` names a regular file (or nothing yet): refuse a FIFO, a device, a socket or a directory before
    anything opens it."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return p
    except OSError as exc:
        raise SettingsError(f"cannot use {what} {p}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SettingsError(f"{what} {p} is not a regular file")
    return p


class _TooLong(Exception):
    pass


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _TooLong(len(digits.lstrip("-")))
    return int(digits)


def load_json(text: str, path: Any, what: str) -> Any:
    """JSON text of a file, or a one-line ConfigError naming the file and where the text breaks (never its
    content): nesting past MAX_NESTING, or an integer of more digits than Python converts, is refused."""
    import json

    try:
        data = json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise ConfigError(f"{path} is nested too deeply to be a {what}") from None
    except _TooLong as exc:
        raise ConfigError(f"{path} holds an integer of {exc.args[0]:,} digits, more than the {MAX_INT_DIGITS:,} "
                          f"a {what} can hold") from None
    _check_shape(data, path, what, yaml=False)
    return data


def load_yaml(text: str, path: Any, what: str) -> Any:
    """YAML text with PyYAML's safe loader (no Python objects), its aliases bounded: the document with every alias
    expanded holds at most MAX_YAML_NODES nodes and nests at most MAX_NESTING deep; keys are text."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_graph(node, path, what)
        data = loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = str(getattr(exc, "problem", None) or exc).splitlines()[0][:120]
        raise ConfigError(f"{path} is not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path} is nested too deeply to be a {what}") from None
    except ValueError:  # an integer past Python's 4,300-digit conversion limit (construct_yaml_int)
        raise ConfigError(f"{path} holds an integer of more than {MAX_INT_DIGITS:,} digits: not a {what}") from None
    finally:
        loader.dispose()
    _check_shape(data, path, what, yaml=True)
    return data


def _check_yaml_graph(root: Any, path: Any, what: str) -> None:
    """The node graph's size with aliases expanded (an alias is the anchored node itself, so shared nodes are
    counted once per reference, by memoised sizes: linear in the file), and its depth."""
    import yaml

    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    on_path: set[int] = set()

    def walk(node: Any) -> tuple[int, int]:
        key = id(node)
        if key in sizes:
            return sizes[key], depths[key]
        if key in on_path:  # a recursive alias (&a [*a]): PyYAML builds a cyclic object
            raise ConfigError(f"{path} refers to itself through a YAML alias: not a {what}")
        on_path.add(key)
        size, depth = 1, 0
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [x for pair in node.value for x in pair]
        else:
            children = []
        for child in children:
            s, d = walk(child)
            size += s
            depth = max(depth, d)
            if size > MAX_YAML_NODES:
                break
        on_path.discard(key)
        sizes[key], depths[key] = min(size, MAX_YAML_NODES + 1), depth + 1
        return sizes[key], depths[key]

    try:
        size, depth = walk(root)
    except RecursionError:
        raise ConfigError(f"{path} is nested too deeply to be a {what}") from None
    if size > MAX_YAML_NODES:
        raise ConfigError(f"{path} expands to more than {MAX_YAML_NODES:,} values through YAML aliases: not a "
                          f"{what}")
    if depth > MAX_NESTING:
        raise ConfigError(f"{path} is nested too deeply to be a {what}")


def _check_shape(data: Any, path: Any, what: str, yaml: bool) -> None:
    """Nesting at most MAX_NESTING deep; mapping keys are text (a YAML key such as ``1:`` or ``true:`` is not a
    setting's name)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_NESTING:
            raise ConfigError(f"{path} is nested too deeply to be a {what}")
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ConfigError(f"{path}: the key {quote(k)} is not text (a {what}'s keys are setting "
                                      "names)")
                stack.append((v, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def load_mapping_file(path: Any, what: str) -> dict[str, Any]:
    """A JSON or YAML object (by the file's suffix) from a regular file."""
    text = read_text(path, what)
    data = load_yaml(text, path, what) if str(path).endswith((".yaml", ".yml")) else load_json(text, path, what)
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of settings (a JSON object or YAML mapping)")
    return data


def quote(value: Any, limit: int = 60) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters; containers are shown a few items and
    levels deep, so a value aliased a billion times over (YAML) is never expanded, and an integer too long to
    print is described."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 2, 4, 4, 4, 4
    r.maxstring, r.maxother, r.maxlong = limit, limit, limit

    def repr_int(x: int, level: int) -> str:
        if x.bit_length() > 256:
            return f"<an integer of {x.bit_length():,} bits>"
        return reprlib.Repr.repr_int(r, x, level)

    r.repr_int = repr_int  # type: ignore[method-assign]
    try:
        text = r.repr(value)
    except Exception:  # a value whose repr itself fails
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _Deadline(BaseException):
    """Raised inside a regular expression's match by SIGALRM (a BaseException: nothing on the way swallows it)."""


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Run the block for at most ``seconds`` (SIGALRM, in the main thread on POSIX; Python's regular expression
    engine checks for signals while it backtracks); past it, a one-line SettingsError: ``what`` took too long.
    Elsewhere (another thread) the block runs without a limit. Nested deadlines keep the outer one's end."""
    import signal
    import threading

    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getitimer(signal.ITIMER_REAL)[0]:  # an outer deadline is running: stay inside it
        yield
        return
    active = [True]  # cleared before the timer is: a signal on the way out raises nothing

    def stop(_signum: int, _frame: Any) -> None:
        if active[0]:
            raise _Deadline()

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
        active[0] = False
    except _Deadline:
        raise SettingsError(f"{what} did not finish within {seconds:g} s (a regular expression that backtracks "
                            f"without end?)") from None
    finally:
        active[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


#: the time user regular expressions may take over one model's modules
REGEX_SECONDS = 1.0


def compile_pattern(pattern: str, what: str) -> Any:
    """A user's regular expression, compiled, or a one-line SettingsError: ``what`` (ending in ":" when it names
    the value itself), else ``what`` and the pattern, then why."""
    import re

    try:
        return re.compile(pattern)
    except (re.error, RecursionError, OverflowError, ValueError) as exc:
        shown = what[:-1] if what.endswith(":") else f"{what} {quote(pattern)}"
        raise SettingsError(f"{shown} is not a regular expression: {exc}") from None


def _mode_for(p: Path) -> int:
    try:
        return os.stat(p).st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_atomic(path: Any, data: bytes | str, what: str) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it and a rename, so a reader never sees half a
    file and an interrupted write leaves none; a target that exists and is not a regular file (a FIFO, a device,
    a directory) is refused before anything is written."""
    import tempfile

    p = check_regular(path, what)
    raw = data.encode() if isinstance(data, str) else data
    parent = p.parent if str(p.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise SettingsError(f"cannot write {what} {p}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
        os.chmod(tmp, _mode_for(p))  # mkstemp makes it 0600: the mode the file has, or a new file's
        os.replace(tmp, p)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise SettingsError(f"cannot write {what} {p}: {exc.strerror or exc}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
