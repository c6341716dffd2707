"""What of Ray's and Serve's output reaches the terminal (jobs/ray_output.py), on Ray's own dispatcher and Serve's
own logger setup, without starting Ray. The CLI runs that check a whole sweep's terminal are in tests/test_sweep.py
(default) and tests/test_reproducible.py (--verbose)."""

import logging
import re

import pytest

from jobs import ray_output

# a line of Ray's driver logger ("2026-11-25 19:54:05,375\tINFO worker.py:2038 -- ..."), of Serve's ("INFO
# 2026-11-25 20:20:51,347 serve 26773 -- ...") or one an actor printed ("(EvalActor pid=1234) ...")
RAY_LINE = re.compile(r"^\S+ \S+\s+(DEBUG|INFO|WARNING) \S+\.py:\d+ -- |^(DEBUG|INFO|WARNING) \d{4}-\d\d-\d\d "
                      r"|\(([^()\s]+ )?pid=\d+\)", re.M)


@pytest.fixture(autouse=True)
def serve_logger():
    """Serve's driver logger, with what keep_quiet adds to it taken off after the test."""
    serve = logging.getLogger("ray.serve")
    yield serve
    for f in [f for f in serve.filters if isinstance(f, ray_output._ErrorsOnly)]:
        serve.removeFilter(f)


@pytest.fixture
def ray_printer():
    """A stand-in for the printer ray.init registers, on Ray's real dispatcher; removed after."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    printed = []
    dispatcher.add_handler(ray_output.RAY_PRINTER, printed.append)
    yield dispatcher, printed
    dispatcher.remove_handler(ray_output.RAY_PRINTER)


def test_only_raysweeps_own_actor_lines_are_forwarded(ray_printer):
    dispatcher, printed = ray_printer
    ray_output.keep_quiet(verbose=False)
    ray_output.keep_quiet(verbose=False)  # twice (verify's sweep after a run, say): wrapped once
    batch = {"pid": 4242, "ip": "127.0.0.1", "is_err": True, "actor_name": "EvalActor",
             "lines": ["FutureWarning: `past_key_values` is deprecated", "[raysweep] CUDA graph start failed (x); "
                       "starting eager", "INFO 11-25 12:00:00 [core.py:1] vLLM engine started"]}
    dispatcher.emit(batch)
    dispatcher.emit({**batch, "lines": ["noise only"]})
    assert printed == [{**batch, "lines": ["[raysweep] CUDA graph start failed (x); starting eager"]}]


def test_verbose_forwards_every_actor_line(ray_printer):
    dispatcher, printed = ray_printer
    ray_output.keep_quiet(verbose=True)
    dispatcher.emit({"pid": 1, "is_err": False, "lines": ["anything"]})
    assert printed == [{"pid": 1, "is_err": False, "lines": ["anything"]}]


def test_serves_driver_logger_shows_errors_only_also_after_serve_sets_it_up(serve_logger):
    from ray.serve._private.logging_utils import configure_default_serve_logger

    serve = serve_logger
    ray_output.keep_quiet(verbose=False)
    configure_default_serve_logger()  # what importing ray.serve does: its level INFO, its handlers anew
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    serve.addHandler(handler)
    try:
        serve.info("Deployed app 'raysweep-pool' successfully.")
        serve.warning("a replica is slow to start")
        serve.error("the controller is gone")
    finally:
        serve.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["the controller is gone"]
