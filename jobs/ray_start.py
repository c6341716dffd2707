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
    `local` is ray.init's own; a Ray Client address (`ray://`) has no GCS to ask, and serves only where `ray_client`
    (the pool's commands: a sweep's driver asks the autoscaler and reads the GCS, which Ray Client does not offer)."""
    if address.startswith("ray://") and not ray_client:
        raise RayStartError(f"{named} {address}: a Ray Client address, which a sweep cannot run through (it asks the "
                            "autoscaler and reads Ray's GCS): give the head's GCS address (`ray start --head --port`, "
                            "6379 by default), or submit the sweep with `ray job submit`")
    if address == "local" or address.startswith("ray://"):
        return
    if address != "auto":
        host, sep, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
        if not sep or not port.isdigit():
            return  # not host:port: ray.init says what it makes of it
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_PROBE_S) as probe:
                web = _answers_http(probe)
        except OSError as e:
            raise RayStartError(f"{named} {address}: no Ray there to connect to ({e.strerror or e})") from None
        if web:
            raise RayStartError(f"{named} {address}: a web server answers there, not a Ray cluster's GCS (the Ray "
                                "dashboard's port?): give the head's GCS address, `ray start --head --port` (6379 by "
                                "default)")
    answer = gcs_answer(address)
    if answer == "silent" and address != "auto":
        raise RayStartError(f"{named} {address}: something listens there, but no Ray GCS answered in "
                            f"{GCS_ANSWER_S:.0f} s: give the head's GCS address, `ray start --head --port` (6379 by "
                            "default)")
    if answer == "token":
        sent = ("the token this command sends (RAY_AUTH_MODE=token) is not the cluster's: put the cluster's token in "
                "~/.ray/auth_token, the file RAY_AUTH_TOKEN_PATH names, or RAY_AUTH_TOKEN"
                if os.environ.get("RAY_AUTH_MODE") == "token" else
                "this command sends none: `export RAY_AUTH_MODE=token`, with the cluster's token in ~/.ray/auth_token, "
                "the file RAY_AUTH_TOKEN_PATH names, or RAY_AUTH_TOKEN")
        raise RayStartError(f"{named} {address}: the Ray there asks for a token (token authentication), and {sent}")


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
