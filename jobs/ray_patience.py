"""A local Ray that starts on a busy machine: ray.init waits as long as the machine needs, up to a bound the user
sets, and says what it waits for.

Ray 2.60 gives its node 30 s to register with its GCS (ray/_private/node.py, `raylet_start_wait_time_s`, a local
variable, not a setting) and then fails with "The current node timed out during startup": on a 2-core machine at a
load of 15-21 that happened again and again. That loop asks `ray._private.services.get_node` and retries while it
raises RuntimeError; while `patient_start` holds, one such call keeps asking until the node is there or
RAYSWEEP_RAY_START_TIMEOUT_S passed, so the start fails only after that bound (Ray's 30 s have passed by then).
Meanwhile a line every SAY_EVERY_S seconds says the start is still going and what it waits for.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

ENV = "RAYSWEEP_RAY_START_TIMEOUT_S"
DEFAULT_S = 300.0
SAY_EVERY_S = 10.0
ASK_EVERY_S = 0.5


def start_bound_s() -> float:
    """How long a local Ray's start may take (RAYSWEEP_RAY_START_TIMEOUT_S, seconds; default 300)."""
    raw = os.environ.get(ENV)
    if raw is None:
        return DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{ENV}={raw!r}: a number of seconds above 0")
    return value


@contextmanager
def patient_start(bound_s: float, say=print):
    """While it holds: Ray's wait for its node to register lasts up to `bound_s`, and every SAY_EVERY_S seconds
    `say` gets a line of how long the start has taken and what it waits for."""
    import ray._private.services as services

    real = services.get_node
    started = time.monotonic()
    waiting = {"for": "Ray's processes to start"}

    def get_node(*args, **kwargs):
        while True:
            try:
                return real(*args, **kwargs)
            except RuntimeError:  # not registered yet: Ray's loop would count this against its 30 s
                if time.monotonic() - started > bound_s:
                    raise
                waiting["for"] = "Ray's node to register with its GCS"
                time.sleep(ASK_EVERY_S)

    done = threading.Event()

    def tell() -> None:
        while not done.wait(SAY_EVERY_S):
            say(f"[raysweep] still starting a local Ray ({time.monotonic() - started:.0f} s, up to {bound_s:g} s: "
                f"{ENV}): waiting for {waiting['for']}; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPU(s)")

    teller = threading.Thread(target=tell, name="ray-start-teller", daemon=True)
    services.get_node = get_node
    teller.start()
    try:
        yield
    finally:
        done.set()
        services.get_node = real
        teller.join(timeout=1)
