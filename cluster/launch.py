"""The one place where the driver reaches into actors/: the classes it starts as Ray actors or Serve
replicas, and the engine host process of a local run (actors/engine_host.py, started by module name). Everything else in cluster/ knows actors only through the contracts (cluster/contracts/), and the
import rules (tests/test_architecture.py) hold it to that. Imported lazily, so the driver's planning never
loads the actors' engine code."""

from __future__ import annotations


def eval_actor_class():
    """EvalActor: one GPU share's engines, started by a sweep's scheduler (cluster/schedule/run.py)."""
    from actors.evaluator import EvalActor

    return EvalActor


def pool_replica():
    """PoolReplica: the engine pool's model deployments (cluster/pool/serve_app.py)."""
    from actors.pool_replica import PoolReplica

    return PoolReplica


HOST_SWITCH = "RAYSWEEP_ENGINE_HOST"  # 0: no engine host; each actor imports and runs its engines itself
MAX_SOCKET_PATH = 100  # bytes: Linux's Unix socket paths end at 107


def start_engine_host(backends) -> "EngineHost | None":
    """A run's engine host, started now; None where RAYSWEEP_ENGINE_HOST=0 turns it off, or where it
    cannot start (said in one line: the actors then import and run their engines themselves)."""
    import os
    import sys

    if os.environ.get(HOST_SWITCH, "1") == "0":
        return None
    try:
        return EngineHost(backends)
    except OSError as e:
        print(f"[raysweep] no engine host ({e}): the actors import and run their engines themselves",
              file=sys.stderr, flush=True)
        return None


def engines_in_actors(backends, reproducible: bool) -> bool:
    """Whether a run's actors must run their engines in their own processes, with no engine host: a reproducible
    run that may run vLLM, whose batch-invariant setting is the actor's process's (actors/evaluator.py). The CPU
    engine's is its start's. Told without importing torch: `auto` may be vLLM wherever vLLM is installed."""
    import importlib.util

    cpu = {"hf", "fake"} | ({"auto"} if importlib.util.find_spec("vllm") is None else set())
    return reproducible and not set(backends) <= cpu


def cluster_on_this_machine() -> bool:
    """Whether every live node of the Ray cluster this process joined runs on this machine, and no autoscaler can
    add one elsewhere (a workstation's `ray start`, of one node or several): each actor then reaches an engine host
    this process starts. Ray's node table, and this machine's processes for the autoscaler (its head is here)."""
    import ray

    from cluster.plan.placement import read_node_types

    here = ray.util.get_node_ip_address()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if not nodes or any(n.get("NodeManagerAddress") != here for n in nodes):
        return False
    return not read_node_types(ray.get_runtime_context().gcs_address.rsplit(":", 1)[-1])


FOLDER_PREFIX = "raysweep-engine-host-"


def remove_stale_folders(parent: str, prefix: str = FOLDER_PREFIX) -> None:
    """The folders named `PREFIX` + their driver's pid whose driver was killed (kill -9 leaves them): an engine
    host's (a socket, a log); a command's temporary output (jobs/lifecycle.py). Those of drivers no longer running
    are removed; another user's, or one that cannot be read, is left alone."""
    import os
    import shutil

    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        except OSError:
            pass


class EngineHost:
    """A run's engine host (cluster/contracts/engine_host.py): a local run's started before Ray, so the engines'
    libraries are imported while Ray starts (a run that joins a cluster on this machine starts it once Ray is
    joined, jobs/lifecycle.py); stopped after the run (and killed with the driver, however it
    goes). It runs in a session of its own (Ctrl-C in the terminal is the driver's). Its output goes to a file
    beside its socket, said in one line if the host ended by itself."""

    def __init__(self, backends) -> None:
        import os
        import shutil
        import socket
        import subprocess
        import sys
        import tempfile

        from cluster.contracts.engine_host import HOST_MODULE, EngineHostAddress

        prefix = f"{FOLDER_PREFIX}{os.getpid()}-"  # only this user enters it; named by its driver
        self.folder = tempfile.mkdtemp(prefix=prefix)
        if len(os.path.join(self.folder, "host.sock").encode()) > MAX_SOCKET_PATH:  # a long TMPDIR
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        remove_stale_folders(os.path.dirname(self.folder))
        path = os.path.join(self.folder, "host.sock")
        try:
            self._log = open(os.path.join(self.folder, "host.log"), "wb")
            # listening before the host's Python has started: an actor that comes at any time after finds it
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
                server.bind(path)
                server.listen(64)
                self.process = subprocess.Popen(
                    [sys.executable, "-m", HOST_MODULE, str(server.fileno()), ",".join(sorted(set(backends))),
                     str(os.getpid())], pass_fds=[server.fileno()], stdin=subprocess.DEVNULL, stdout=self._log,
                    stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        self.address = EngineHostAddress(path, self.process.pid)
        self._early: list = []  # (the driver's connection, the socket's path) of each early engine asked for

    def start_early(self, engines) -> None:
        """Ask for the early engines `engines` (cluster/plan/early_engines.py EarlyEngine), one connection each,
        kept open for as long as an engine may wait for its actor: the host takes them once its imports are done
        and forks each its engine process. Each built under this process's environment with the engine's own.
        Each engine's socket is bound and listening here, before this returns, and handed to its engine process:
        an actor that comes while the host still imports finds it and waits there for that engine."""
        import os
        import socket
        from multiprocessing.connection import Client
        from multiprocessing.reduction import send_handle

        from cluster.contracts.engine_host import EARLY, early_path

        for engine in engines:
            path = early_path(self.address, engine.key, engine.slot)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
                listener.bind(path)
                listener.listen(1)
                conn = Client(self.address.path, "AF_UNIX")
                self._early.append((conn, path))
                conn.send({EARLY: engine.key, "path": path, "cwd": os.getcwd(), "env": {**os.environ, **engine.env},
                           "start": engine.start, "threads": engine.threads})
                send_handle(conn, listener.fileno(), self.address.host_pid)

    def drop_early(self) -> None:
        """Let go of the early engines: one no actor took ends, with its engine's processes, and its socket goes
        (an actor that comes later asks the host)."""
        import os

        early, self._early = self._early, []
        for conn, path in early:
            conn.close()
            try:
                os.unlink(path)
            except FileNotFoundError:  # taken: its engine process removed it
                pass

    def stop(self) -> None:
        import os
        import shutil
        import sys

        self.drop_early()
        ended = self.process.poll()
        if ended is None:
            self.process.kill()
        self.process.wait()
        self._log.close()
        if ended:  # it died by itself: its imports failed, say
            with open(os.path.join(self.folder, "host.log"), "rb") as f:
                lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
            print(f"[raysweep] the engine host ended early (exit {ended}): {lines[-1] if lines else 'no output'}",
                  file=sys.stderr, flush=True)
        shutil.rmtree(self.folder, ignore_errors=True)
