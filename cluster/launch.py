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


def start_engine_host(backends) -> "EngineHost | None":
    """A local run's engine host, started now; None where RAYSWEEP_ENGINE_HOST=0 turns it off."""
    import os

    return None if os.environ.get(HOST_SWITCH, "1") == "0" else EngineHost(backends)


class EngineHost:
    """A local run's engine host (cluster/contracts/engine_host.py): started before Ray, so the engines'
    libraries are imported while Ray starts; stopped after the run (and killed with the driver, however it
    goes). Its output goes to a file beside its socket, read back only if it failed."""

    def __init__(self, backends) -> None:
        import os
        import socket
        import subprocess
        import sys
        import tempfile

        from cluster.contracts.engine_host import HOST_MODULE, EngineHostAddress

        self.folder = tempfile.mkdtemp(prefix="raysweep-engine-host-")  # only this user enters it
        path = os.path.join(self.folder, "host.sock")
        self._log = open(os.path.join(self.folder, "host.log"), "wb")
        # listening before the host's Python has started: an actor that comes at any time after finds it
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(path)
            server.listen(64)
            self.process = subprocess.Popen([sys.executable, "-m", HOST_MODULE, str(server.fileno()),
                                             ",".join(sorted(set(backends))), str(os.getpid())],
                                            pass_fds=[server.fileno()], stdin=subprocess.DEVNULL, stdout=self._log,
                                            stderr=subprocess.STDOUT)
        self.address = EngineHostAddress(path, self.process.pid)

    def stop(self) -> None:
        import shutil

        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._log.close()
        shutil.rmtree(self.folder, ignore_errors=True)
