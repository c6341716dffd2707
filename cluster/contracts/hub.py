"""Whether the Hugging Face hub can be reached (`hub_unreachable`), and its offline switches set where it cannot
(`offline_where_unreachable`): without network, Hugging Face's clients retry for a minute before they fail."""

from __future__ import annotations

import os
import socket
import threading
import urllib.parse

HUB_PROBE_S = 2.0  # one connection attempt to the hub, no retries: without network, say so at once
OFFLINE_SWITCHES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached, or None where it may be: the offline switches, else one
    TCP connection to the hub's host within HUB_PROBE_S (Hugging Face's own client retries for a minute)."""
    for switch in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(switch, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return f"{switch} is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # through a proxy: a direct connection says nothing
    url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname, url.port or (80 if url.scheme == "http" else 443)
    answer: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_S).close()
            answer.append(None)
        except OSError as e:
            answer.append(f"{host}: {e.strerror or e}")

    # on a thread: a name lookup without network may block longer than any socket timeout
    thread = threading.Thread(target=probe, name="raysweep-hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_PROBE_S)
    return answer[0] if answer else f"{host}: no answer in {HUB_PROBE_S:g} s"


def offline_where_unreachable() -> None:
    """`datasets` and `huggingface_hub` offline where the hub cannot be reached: they read their switches as they
    are imported, so this comes before (lm-eval's import, cluster/lm_eval/run.py); a switch already set is kept."""
    if hub_unreachable():
        for switch in OFFLINE_SWITCHES:
            os.environ.setdefault(switch, "1")
