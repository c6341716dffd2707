"""A code_exec row's program: the task's template formatted over the row's columns and the model's completion,
and the check that the completion cannot reach into what follows it.

A completion is text the program's template places before its tests. Text that leaves something open at its
end (a line continuation, an unclosed bracket or string, a block opener such as `if 0:`) would take the
template's next line (the test's first) into itself: `if 0: \\` before `assert f() == 2` makes the assert dead,
the program reaches its end and would pass. So the program's text up to the completion's end must compile on its
own; where it does not, the row scores 0 with the reason, and no sandbox runs it. Where it does, nothing of the
completion continues into the lines after it: each of those starts a new statement. (The template's text after
the completion is the task's, not the model's.) What remains is the class docs/scoring.md names: a program that
reads the harness's memory.
"""

from __future__ import annotations

import uuid
import warnings

from cluster.contracts.task_spec import COMPLETION

_MARK = f"\x00completion-{uuid.uuid4().hex}\x00"  # in no template or column: where the completion goes


def program_of(template: str, columns: dict, completion: str) -> tuple[str, str | None]:
    """The row's program, and why it must not run (None where it may)."""
    program = template.format(**columns, **{COMPLETION: completion})
    marked = template.format(**columns, **{COMPLETION: _MARK})
    end = marked.rfind(_MARK)
    if end < 0:  # the completion placed through a conversion or format spec: its end cannot be told
        return program, None
    head = marked[:end].replace(_MARK, completion) + completion
    return program, _open_end(head)


def _open_end(head: str) -> str | None:
    """Why the program's text up to the completion's end does not compile on its own, or None."""
    try:
        with warnings.catch_warnings():  # an invalid escape in the completion: not the driver's to print
            warnings.simplefilter("ignore")
            compile(head, "program.py", "exec", dont_inherit=True)
    except SyntaxError as e:
        where = f", line {e.lineno}" if e.lineno else ""
        return (f"the program up to the end of the completion does not compile on its own ({type(e).__name__}: "
                f"{e.msg}{where}): not run, so nothing after it (the tests) is taken into it")
    except (ValueError, RecursionError, MemoryError, OverflowError) as e:
        return f"the program up to the end of the completion cannot be compiled ({type(e).__name__}: {e}): not run"
    return None
