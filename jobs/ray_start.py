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
AUTH_PROBE_S = 5.0  # the longest the token check waits for Ray's GCS client (it answers in about 0.3 s)


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


def check_ray_address(address: str, named: str) -> None:
    """An explicit `host:port` must accept a TCP connection within RAY_PROBE_S: where nothing listens,
    ray.init retries for minutes and ends in a 30-line traceback. Then a Ray there (or the one `auto` finds) that
    asks for a token this command does not send is one line (`check_token`). `local` is ray.init's own."""
    if address == "local":
        return
    if address == "auto":
        check_token(address, named)
        return
    host, sep, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        return  # not host:port: ray.init says what it makes of it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_PROBE_S).close()
    except OSError as e:
        raise RayStartError(f"{named} {address}: no Ray there to connect to ({e.strerror or e})") from None
    check_token(address, named)


def check_token(address: str, named: str) -> None:
    """Where the Ray at `address` uses token authentication and this command sends no token (RAY_AUTH_MODE is not
    `token`) or another one, ray.init retries for 20 s, a warning line a second, and then says only that it did
    not connect. Ray's GCS client refuses at once (about 0.3 s, after one warning line of Ray's own): asked first,
    once per address (`token_refused`); whatever else it answers is left to ray.init."""
    if token_refused(address):
        sent = ("the token this command sends (RAY_AUTH_MODE=token) is not the cluster's: put the cluster's token in "
                "~/.ray/auth_token, the file RAY_AUTH_TOKEN_PATH names, or RAY_AUTH_TOKEN"
                if os.environ.get("RAY_AUTH_MODE") == "token" else
                "this command sends none: `export RAY_AUTH_MODE=token`, with the cluster's token in ~/.ray/auth_token, "
                "the file RAY_AUTH_TOKEN_PATH names, or RAY_AUTH_TOKEN")
        raise RayStartError(f"{named} {address}: the Ray there asks for a token (token authentication), and {sent}")


@functools.cache
def token_refused(address: str) -> bool:
    """Whether the GCS of the Ray at `address` (`auto`: the one `ray start` runs here) refused this process's
    token, asked within AUTH_PROBE_S; False where it answered otherwise, or not in time (no GCS there: ray.init then
    says what it is), and for a Ray Client address (`ray://`), which has no GCS to ask."""
    import threading

    from ray._private.services import canonicalize_bootstrap_address
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    if address.startswith("ray://"):
        return False
    refused: list[bool] = []

    def probe() -> None:
        try:
            resolved = canonicalize_bootstrap_address(address)
            if resolved is not None:
                GcsClient(address=resolved)
        except AuthenticationError:
            refused.append(True)
        except Exception:  # noqa: BLE001  (no Ray there, another service: ray.init says what it is)
            pass

    thread = threading.Thread(target=probe, name="raysweep-token-probe", daemon=True)
    thread.start()
    thread.join(AUTH_PROBE_S)
    return bool(refused)
