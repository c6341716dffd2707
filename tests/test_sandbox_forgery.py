"""A program cannot forge the harness's proof that it ran to the end. Each route below is a program that looks
for the harness's completion token where a Python program can look (modules, frames, the garbage collector,
a trace function, its files, fds and environment), writes "completed TOKEN" on the status pipe for whatever it
found, and leaves with os._exit(0) before its failing test; or one that bends the harness's own code path
(its exit, its functions). None passes. Before the token left the program's reach (a module global `nonce`
of the bootstrap, read back by a `report` it could call), every route from "sys.modules" to "a no-op
sys.exit for the harness" passed except the files, fds and environment; the others already failed."""

import pytest

from cluster.score.sandbox import SandboxLimits, run_program
from cluster.score.sandbox_outcome import COMPLETED, FORGED, _ending

LIMITS = SandboxLimits(timeout_s=10)

# found: every 32-hex-digit string or bytes seen; forge(): claims completion with each, then leaves with 0
PRELUDE = r"""
import gc, json, os, string, sys
found = set()
def look(x):
    if isinstance(x, (bytes, bytearray)):
        x = bytes(x).decode("latin-1")
    if isinstance(x, str) and len(x) == 32 and all(c in string.hexdigits for c in x):
        found.add(x)
def look_in(mapping):
    for value in list(dict(mapping).values()):
        look(value)
def forge():
    config = [a for a in open("/proc/self/cmdline", "rb").read().split(b"\0") if a.startswith(b"{")]
    fd = json.loads(config[0])["status_fd"]
    for token in sorted(found):
        os.write(fd, ("completed " + token + "\n").encode())
    os._exit(0)
"""

ROUTES = {
    # the bootstrap's globals were __main__'s, with the nonce among them
    "sys.modules": "for m in list(sys.modules.values()):\n    look_in(vars(m))\nforge()",
    # the frame that exec'd the program had the nonce in its globals
    "caller frames, their globals and locals": (
        "f = sys._getframe()\nwhile f is not None:\n    look_in(f.f_globals); look_in(f.f_locals)\n"
        "    f = f.f_back\nforge()"),
    "inspect.stack": "import inspect\nfor info in inspect.stack():\n    look_in(info.frame.f_globals)\n"
                     "    look_in(info.frame.f_locals)\nforge()",
    "a traceback's frames": (
        "try:\n    raise ValueError\nexcept ValueError as e:\n    tb = e.__traceback__\nf = tb.tb_frame\n"
        "while f is not None:\n    look_in(f.f_locals); look_in(f.f_globals); f = f.f_back\nforge()"),
    "every thread's frames": "for f in sys._current_frames().values():\n    while f is not None:\n"
                             "        look_in(f.f_locals); look_in(f.f_globals); f = f.f_back\nforge()",
    # the __main__ dict, the frames' value stacks, closures and defaults are all gc referents
    "gc.get_objects and gc.get_referents": (
        "for o in gc.get_objects():\n    look(o)\n    for r in gc.get_referents(o):\n        look(r)\n"
        "        if isinstance(r, (tuple, list)):\n            [look(i) for i in r]\n"
        "f = sys._getframe()\nwhile f is not None:\n    [look(r) for r in gc.get_referents(f)]; f = f.f_back\n"
        "forge()"),
    "gc.get_referrers of the harness's functions": (
        "for o in gc.get_objects():\n    if callable(o) and getattr(o, '__defaults__', None):\n"
        "        [look(d) for d in o.__defaults__]\n"
        "    for c in getattr(o, '__closure__', None) or ():\n        look(c.cell_contents)\n"
        "    for r in gc.get_referrers(o) if isinstance(o, type(forge)) else ():\n"
        "        look_in(r) if isinstance(r, dict) else None\nforge()"),
    # already failed before: stdin (the nonce, then) was a file the bootstrap had swapped for /dev/null
    "its files, fds and environment": (
        "import glob\nlook_in(os.environ)\n"
        "for path in ['/proc/self/environ', '/proc/self/cmdline', *glob.glob('/proc/*/fd/*'),\n"
        "             *glob.glob('/proc/*/environ'), *glob.glob('/proc/*/cmdline'), *glob.glob('/tmp/**', recursive=True),\n"
        "             *glob.glob(os.getcwd() + '/**', recursive=True)]:\n"
        "    try:\n        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)\n    except OSError:\n        continue\n"
        "    try:\n        data = os.read(fd, 1 << 20)\n    except OSError:\n        data = b''\n    os.close(fd)\n"
        "    for word in data.replace(b'\\0', b' ').replace(b'\\n', b' ').replace(b'\"', b' ').split():\n"
        "        look(word)\n"
        "for fd in range(256):\n    try:\n        look(os.pread(fd, 64, 0))\n    except OSError:\n        pass\n"
        "forge()"),
    # the nonce was in the bootstrap's frame, whose except clause a trace function sees line by line
    "a trace function on every frame": (
        "def tracer(frame, event, arg):\n    look_in(frame.f_locals); look_in(frame.f_globals)\n"
        "    if found:\n        forge()\n    return tracer\n"
        "f = sys._getframe()\nwhile f is not None:\n    f.f_trace = tracer; f = f.f_back\nsys.settrace(tracer)"),
    "os._exit(0) before its tests": "os._exit(0)",
    "raise SystemExit(0) before its tests": "raise SystemExit(0)",
    # the except clause called sys.exit, then fell through to the report of completion
    "a no-op sys.exit for the harness": "sys.exit = lambda *args: None\nimport traceback\n"
                                        "traceback.print_exception = lambda *args, **kwargs: None",
    "the harness's functions replaced": (
        "import builtins\nsys.exit = os._exit = lambda *args: None\n"
        "builtins.sorted = lambda *args, **kwargs: None\n"
        "for o in gc.get_objects():\n    if isinstance(o, type(forge)) and o.__module__ in ('__main__', 'program')\\\n"
        "            and o is not forge and o.__name__ != 'look':\n"
        "        o.__code__ = (lambda *args, **kwargs: 0).__code__; o.__defaults__ = None"),
}


@pytest.mark.parametrize("route", ROUTES)
def test_a_program_cannot_forge_its_completion(route):
    program = PRELUDE + ROUTES[route] + "\nassert False, 'its tests failed'\n"
    out = run_program(program, LIMITS)
    assert out.status != "passed", (route, out)
    assert out.status in ("failed", "error"), (route, out.status, out.error, out.stderr[-2000:])


@pytest.mark.parametrize("as_main", [False, True])
def test_a_program_that_runs_to_the_end_still_passes_after_looking(as_main):
    """Looking everywhere (the gc route, the cheapest that saw the token before) and then running its tests to
    the end: it passes, and found nothing that is the token."""
    looked = PRELUDE + ROUTES["gc.get_objects and gc.get_referents"].replace("forge()", "")
    out = run_program(looked + "print(sorted(found))\nassert 1 + 1 == 2\n", LIMITS, as_main=as_main)
    assert out.status == "passed", (out.error, out.stderr[-2000:])


def test_a_wrong_token_fails_even_beside_the_right_one():
    """One try: any completion line with another token fails the program, whatever else the pipe says."""
    token = "ab" * 16
    assert _ending(["ready", f"completed {token}"], token) == COMPLETED
    assert _ending(["ready", f"completed {'cd' * 16}", f"completed {token}"], token) == FORGED
    assert _ending(["ready", f"completed {token}", "completed"], token) == FORGED
    program = "import os, json\n" \
              "cfg = [a for a in open('/proc/self/cmdline', 'rb').read().split(b'\\0') if a.startswith(b'{')]\n" \
              "os.write(json.loads(cfg[0])['status_fd'], b'completed ' + b'0' * 32 + b'\\n')\n"
    out = run_program(program, LIMITS)  # it ran to the end, but claimed completion itself: failed
    assert (out.status, out.error) == ("failed", "claimed to have run to the end with a token the harness did not "
                                                 "give it (a forged completion)")


def test_a_failing_programs_traceback_shows_its_own_lines_only():
    out = run_program("def f():\n    assert 1 == 2, 'nope'\nf()\n", LIMITS)
    assert out.status == "failed" and out.error == "AssertionError: nope"
    assert 'File "program.py", line 3' in out.stderr and "sorted" not in out.stderr, out.stderr
