"""Ray started or joined for a command: an explicit address probed first (`check_ray_address`), then ray.init
(`start_ray`); either failing is one line naming the address (RayStartError). A local Ray (its reaper started
first by the run, jobs/lifecycle.py) waits as long as a busy machine needs, up to RAYSWEEP_RAY_START_TIMEOUT_S,
saying what it waits for (jobs/ray_patience.py)."""

from __future__ import annotations

import functools
import os
import socket
from contextlib import nullcontext

from cluster.contracts.errors import RaysweepError
from jobs.ray_output import init_options, keep_quiet
from jobs.ray_patience import patient_start, start_bound_s

RAY_PROBE_S = 2.0  # an explicit Ray address must accept a connection this fast (ray.init waits minutes)
GCS_ANSWER_S = 15.0  # the longest the address check waits for Ray's GCS client (a GCS answers in about 0.3 s)


class RayStartError(RaysweepError, ConnectionError):
    """Ray could not be started or reached; the message names the address and where it came from."""


def start_ray(address: str, named: str, dashboard: bool, verbose: bool = False) -> None:
    """ray.init; a Ray that does not start or answer is one line naming the address (RayStartError). Ray's
    and the actors' own log lines only with `verbose` (jobs/ray_output.py)."""
    import ray

    print("[raysweep] starting a local Ray" if address == "local" else f"[raysweep] connecting to Ray at {address}",
          flush=True)
    try:
        bound = start_bound_s()
    except ValueError as e:
        raise RayStartError(str(e)) from None
    # a dashboard can only be chosen for a Ray this process starts
    options = {"include_dashboard": dashboard} if address == "local" else {}
    try:
        with patient_start(bound, say=lambda line: print(line, flush=True)) if address == "local" else nullcontext():
            ray.init(address=address, **init_options(verbose), **options)
    except Exception as e:  # ConnectionError, TimeoutError, Ray's own complaints; a raylet that did not register
        # within the bound is a bare Exception (jobs/ray_patience.py)
        # what was half started the run stops at once (jobs/lifecycle.py, local_ray.shutdown)
        where = "a local Ray did not start" if address == "local" else f"{named} {address}: Ray did not connect"
        raise RayStartError(f"{where}: {(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
    keep_quiet(verbose)


def check_ray_address(address: str, named: str, ray_client: bool = False) -> None:
    """What ray.init would wait on for minutes, or for ever, said in one line first. An explicit `host:port` must
    accept a TCP connection within RAY_PROBE_S (where nothing listens, ray.init retried for minutes and ended in a
    30-line traceback); must not answer as a web server does (the dashboard's port: ray.init retried for ever); and
    its GCS, or the one `auto` finds, must answer within GCS_ANSWER_S and take this command's token (`gcs_answer`).
    `local` is ray.init's own. A Ray Client address (`ray://`) serves only where `ray_client` (the pool's commands:
    a sweep's driver asks the autoscaler and reads the GCS, which Ray Client does not offer); its server is asked
    the same way (`client_answer`: Ray's client retried 30 s, then said only "connection timeout")."""
    client = address.startswith("ray://")
    if client and not ray_client:
        raise RayStartError(f"{named} {address}: a Ray Client address, which a sweep cannot run through (it asks the "
                            "autoscaler and reads Ray's GCS): give the head's GCS address (`ray start --head --port`, "
                            "6379 by default), or submit the sweep with `ray job submit`")
    if address == "local":
        return
    server = "Ray Client server (`ray start --head` serves one on port 10001)" if client else "Ray cluster's GCS"
    advice = "" if client else ": give the head's GCS address, `ray start --head --port` (6379 by default)"
    target = _host_port(address)
    if target is None and address != "auto":
        return  # not host:port: ray.init says what it makes of it
    if target is not None:
        try:
            with socket.create_connection(target, timeout=RAY_PROBE_S) as probe:
                web = _answers_http(probe)
        except OSError as e:
            raise RayStartError(f"{named} {address}: no Ray there to connect to ({e.strerror or e})") from None
        if web:
            dashboard = "" if client else " (the Ray dashboard's port?)"
            raise RayStartError(f"{named} {address}: a web server answers there, not a {server}{dashboard}{advice}")
    answer = client_answer(target) if client else gcs_answer(address)
    if answer == "silent" and address != "auto":
        raise RayStartError(f"{named} {address}: something listens there, but no "
                            f"{'Ray Client server' if client else 'Ray GCS'} answered in "
                            f"{GCS_ANSWER_S:.0f} s{advice}")
    if answer == "token":
        raise RayStartError(f"{named} {address}: the Ray there asks for a token (token authentication), and "
                            f"{_token_advice()}")


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of an explicit address (a Ray Client one's port 10001 where it names none); None for `auto`
    and for what is not host:port (ray.init says what it makes of it)."""
    if address == "auto":
        return None
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if address.startswith("ray://") and (not sep or "]" in port):  # no port: Ray Client's default
        host, port = rest, "10001"
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _token_advice() -> str:
    """Why the cluster refused this command's token, and how to send the right one."""
    if os.environ.get("RAY_AUTH_MODE") == "token":
        return ("the token this command sends (RAY_AUTH_MODE=token) is not the cluster's: put the cluster's token in "
                "~/.ray/auth_token, the file RAY_AUTH_TOKEN_PATH names, or RAY_AUTH_TOKEN")
    return ("this command sends none: `export RAY_AUTH_MODE=token`, with the cluster's token in ~/.ray/auth_token, "
            "the file RAY_AUTH_TOKEN_PATH names, or RAY_AUTH_TOKEN")


def _answers_http(connection: socket.socket) -> bool:
    """Whether what listens on `connection` answers an HTTP/1.0 request as a web server does. A GCS (gRPC, HTTP/2)
    answers with a frame of its own, or not at all within RAY_PROBE_S."""
    try:
        connection.settimeout(RAY_PROBE_S)
        connection.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return connection.recv(5) == b"HTTP/"
    except OSError:
        return False


@functools.cache
def gcs_answer(address: str) -> str:
    """How the GCS of the Ray at `address` (`auto`: the one `ray start` runs here) answers Ray's own client, asked
    once per address: "ok"; "token" (it refused this process's token: about 0.3 s, after one warning line of Ray's
    own); "silent" (no answer within GCS_ANSWER_S: Ray's client waits 40 s and ray.init for ever); "other" (any
    other error: no Ray there, which ray.init then says)."""
    import threading

    from ray._private.services import canonicalize_bootstrap_address
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    answers: list[str] = []

    def ask() -> None:
        try:
            resolved = canonicalize_bootstrap_address(address)
            if resolved is not None:
                GcsClient(address=resolved)
            answers.append("ok" if resolved is not None else "other")
        except AuthenticationError:
            answers.append("token")
        except Exception:  # noqa: BLE001  (no Ray there, another service: ray.init says what it is)
            answers.append("other")

    thread = threading.Thread(target=ask, name="raysweep-gcs-probe", daemon=True)
    thread.start()
    thread.join(GCS_ANSWER_S)
    return answers[0] if answers else "silent"


def client_answer(target: tuple[str, int]) -> str:
    """How the Ray Client server at `target` answers one ping through Ray's own gRPC channel (its token and TLS
    settings): "ok"; "token" (it refused this process's token, in milliseconds); "silent" (no answer within
    GCS_ANSWER_S); "other" (another gRPC service, or an error ray.init then says)."""
    import grpc
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc

    host = f"[{target[0]}]" if ":" in target[0] else target[0]  # an IPv6 address in gRPC's form
    channel = init_grpc_channel(f"{host}:{target[1]}", options=[], asynchronous=False)
    try:
        grpc.channel_ready_future(channel).result(timeout=GCS_ANSWER_S)
        ping = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
        ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(ping, timeout=GCS_ANSWER_S)
        return "ok"
    except grpc.FutureTimeoutError:
        return "silent"
    except grpc.RpcError as e:
        return {grpc.StatusCode.UNAUTHENTICATED: "token", grpc.StatusCode.DEADLINE_EXCEEDED: "silent"}.get(
            e.code(), "other")
    finally:
        channel.close()
