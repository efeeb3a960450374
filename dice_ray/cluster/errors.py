"""One line for an exception a run ended with, whether a Ray actor raised it or the driver did.

Ray streams an actor's own traceback to the console; the line is the summary a user reads last
(``dice-ray train``, ``eval``, ``curate``) and the reason ``dice-ray report`` shows for a stopped run.
Ray is not imported here: a Ray error can only exist once Ray is loaded.
"""

from __future__ import annotations

import re
import sys

__all__ = ["error_line"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)(\(\w+\))?: ")


def error_line(exc: BaseException) -> str:
    """One line for ``exc``, without tracebacks, Ray's ``(Actor pid=N)`` prefixes or colour codes.

    A ``ray.exceptions.RayError`` gives where it was raised and the exception it ended with
    (``Learner.__init__ failed: FileNotFoundError: checkpoint ...: missing tokenizer.json``): a ``RayTaskError``'s
    ``cause`` is the actor's exception; an ``ActorDiedError``'s message holds the creation task's traceback, or why
    the process died. Any other exception gives ``Type: first line of its message``.
    """
    ray_errors = sys.modules.get("ray.exceptions")  # loaded when anything of Ray ran
    if ray_errors is None or not isinstance(exc, ray_errors.RayError):
        words = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {words[0]}" if words else type(exc).__name__
    text = _ANSI.sub("", str(getattr(exc, "error_msg", "") or exc))
    where = re.search(r"ray::([\w.]+)\(", text)
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        words = _ANSI.sub("", str(cause)).strip().splitlines()
        what = f"{type(cause).__name__}: {words[0]}" if words else type(cause).__name__
    else:
        lines = [x.strip() for x in text.splitlines() if x.strip()]
        raised = [x for x in lines if _EXC_LINE.match(x)]
        what = raised[-1] if raised else (lines[0] if lines else type(exc).__name__)
    return f"{where.group(1) if where else 'a Ray actor'} failed: {what}"
