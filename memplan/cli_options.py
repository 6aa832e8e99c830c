"""The command line's options, built from the job request's metadata (memplan/request.py: each field's flag and
help), and the few options that are a command's own. Imported by memplan/cli.py only (typer is imported here too).
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from typing import Annotated, Any, Optional

import typer

from memplan import request as rq
from memplan.errors import MemplanError

Plot = Annotated[Optional[str], typer.Option("--plot", help="Draw stacked bars of per-GPU bytes by category to "
                                            "FILE.svg or FILE.png (estimate: across GPU counts; plan: across the "
                                            "candidates), the GPU's capacity as a line (needs matplotlib: "
                                            "pip install 'memplan[plot]').")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")]
Model = Annotated[str, typer.Argument(..., help=rq.MODEL_HELP)]


def _optional(kind: Any) -> Any:
    """``int | None`` as typer reads it (Optional[int])."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return Optional[args[0]] if len(args) == 1 else kind
    return kind


@functools.lru_cache(maxsize=None)
def _hints(part: type) -> dict[str, Any]:
    """A request part's field types, resolved once per class (typing.get_type_hints walks the whole class)."""
    return typing.get_type_hints(part)


def _option(part: type, name: str, key: rq.Key) -> Any:
    """A request field as a typer option: its flag, help and type (the command line's, where the field parses
    text)."""
    kind = key.cli_type if key.cli_type is not None else _hints(part)[name]
    if key.cli_type is not None:
        kind = Optional[kind]
    return Annotated[_optional(kind), typer.Option(key.flag, help=key.help)]


def request_options(*parts: str | type, only: tuple[str, ...] | None = None, without: tuple[str, ...] = ()) -> Any:
    """A command that takes the options of the request's ``parts`` (names in request.PARTS, or a dataclass whose
    fields carry a request.Key: request.SearchSpace, request.HarnessRun), each declared once by its field's
    metadata; the command receives them in ``**options``. A parameter the command declares itself (its own
    default or help) stays its own; ``only`` / ``without`` pick fields by name. --json stays last in --help."""
    def add(fn: Any) -> Any:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        names = {p.name for p in own}
        kw = inspect.Parameter.KEYWORD_ONLY
        classes = [rq.PARTS[p] if isinstance(p, str) else p for p in parts]
        extra = [inspect.Parameter(name, kw, default=",".join(default) if isinstance(default, tuple) else default,
                                   annotation=_option(cls, name, key))
                 for cls in classes for name, default, key in rq.keys(cls)
                 if key.flag is not None and name not in names and name not in without
                 and (only is None or name in only)]
        last = [p.replace(kind=kw) for p in own if p.name == "as_json"]
        fn.__signature__ = sig.replace(parameters=[p for p in own if p.name != "as_json"] + extra + last)
        return fn
    return add


ALL_PARTS = tuple(rq.PARTS)


def explicit(ctx: typer.Context) -> set[str]:
    """The parameters given on the command line (not defaults)."""
    out = set()
    for name in ctx.params:
        src = ctx.get_parameter_source(name)
        if src is not None and src.name == "COMMANDLINE":
            out.add(name)
    return out


def progress_for(as_json: bool) -> None:
    """Status lines on stderr for slow work (a trace, a long search): a terminal, no --json."""
    from memplan import progress

    progress.enable(progress.wanted(as_json))


def csv(value: str, name: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    if not items:
        raise MemplanError(f"{name} needs at least one value")
    return items
