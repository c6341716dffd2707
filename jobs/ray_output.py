"""What Ray and Ray Serve print in a raysweep command's terminal: raysweep's own lines, and Ray's only when asked.

By default (every command that starts or joins a Ray: run, verify, lm-eval, pool):
1. Ray's driver logger ("ray") shows errors only: its token-auth warning and "Started a local Ray instance"
   stay out. ray.init sets that level before it logs either (`logging_level`).
2. Serve's driver logger ("ray.serve") shows errors only: its INFO lines on deploying and routing stay out.
   A filter on the logger, not its level: importing ray.serve sets that level, and it is imported later.
3. Of what the actors print (library warnings, vLLM's INFO lines), only lines that start with `[raysweep] ` reach
   the terminal, with Ray's `(EvalActor pid=...)` prefix: the engines' own notes (a CUDA-graph start that fell
   back to eager, an engine start tried again). Everything an actor prints stays in Ray's log files, on its node
   under /tmp/ray/session_*/logs (worker-*.out and .err).
A crashed actor is said by the sweep's own lines (`shard ... attempt N failed: actor died: ...`, then a FAILED
line if its retries run out), and Ray's raylet still prints its own message on a worker killed for memory or
lost (Ray prints those apart from the actors' output). `--verbose` shows everything, as Ray does by default.
"""

from __future__ import annotations

import argparse
import functools
import logging

OWN = "[raysweep] "  # how every line of raysweep's own starts, in the driver and in the actors
RAY_PRINTER = "ray_print_logs"  # the name under which ray.init registers its printer of the actors' lines


def add_verbose_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true",
                        help="also show Ray's and Ray Serve's own log lines and everything the actors print")


def init_options(verbose: bool) -> dict:
    """ray.init's own logging arguments: the actors' lines forwarded (filtered by `keep_quiet`), Ray's driver
    logger at ERROR unless verbose."""
    return {"log_to_driver": True, "logging_level": logging.INFO if verbose else logging.ERROR}


def keep_quiet(verbose: bool) -> None:
    """After ray.init: unless verbose, only errors from Serve's driver logger and only `[raysweep] ` lines from
    the actors."""
    if verbose:
        return
    serve = logging.getLogger("ray.serve")
    if not any(isinstance(f, _ErrorsOnly) for f in serve.filters):
        serve.addFilter(_ErrorsOnly())
    _forward_own_lines_only()


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def _forward_own_lines_only() -> None:
    """Wrap the printer ray.init registered for the actors' lines. Ray has no public setting between
    `log_to_driver=False`, which drops the actors' `[raysweep]` lines too, and every line; its printer is one
    handler of a dispatcher in ray._private (Ray is pinned in pyproject.toml, and tests/test_sweep.py's CLI
    test fails if this stops holding back the actors' other lines). No printer (log_to_driver off, a Ray
    client): nothing is forwarded, nothing to filter."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    printers = [handler for name, handler in dispatcher.handlers if name == RAY_PRINTER]
    if not printers or isinstance(printers[0], functools.partial) and printers[0].func is _own_lines:
        return
    dispatcher.remove_handler(RAY_PRINTER)  # ray.shutdown removes it by this name: ours goes with it
    dispatcher.add_handler(RAY_PRINTER, functools.partial(_own_lines, printers[0]))


def _own_lines(printer, batch: dict) -> None:
    """One batch of an actor's lines ({"lines": [...], "pid", "is_err", ...}), only raysweep's own passed on."""
    lines = [line for line in batch.get("lines", []) if line.startswith(OWN)]
    if lines:
        printer({**batch, "lines": lines})
