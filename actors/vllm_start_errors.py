"""How a failed vLLM engine start is read: which failures a neighbour on the same GPU causes (retried), which come
from CUDA graphs or torch.compile (eager may still run), and the one line that names the root cause, read from
the engine core's and its workers' log (vLLM's own exception says only "See root cause above")."""

from __future__ import annotations

import re

# Two start failures that a neighbour on the same GPU causes and that pass (both seen on an H100): vLLM's
# profiling asserts that free memory did not grow while it measured, and it grows when a neighbour's engine
# closes meanwhile (two half-GPU actors, one changing profile); and free memory below the engine's share
# while a neighbour compiles cold (three third-GPU actors: torch.compile's autotuning takes memory for a while)
MEMORY_RACE = re.compile(r"Error in memory profiling|Free memory on device \S+ \([\d.]+/[\d.]+ GiB\) on startup is less than")
# where a failed start came from graph capture or torch.compile (frames or messages): eager may still run
GRAPH_FAILURE = re.compile(r"capture_model|cudagraph|cuda_graph|torch/_dynamo|torch/_inductor|"
                            r"BackendCompilerFailed|InductorError", re.IGNORECASE)


def error_lines(log: str) -> str:
    """The traceback and error lines of an engine core's log (not its start-up report, which names
    Dynamo and CUDA graphs when all is well)."""
    return "\n".join(line for line in log.splitlines() if " ERROR " in line or 'File "' in line or "Error" in line)


def with_root_cause(error: Exception, core_log: str) -> Exception:
    """A failed start's error, naming the root cause that the engine core or its workers logged where vLLM's says only "See root
    cause above" (that line is in the actor's log, not in what the driver reports); else `error` as it is."""
    root = failure_line(error, core_log)
    if root == failure_line(error, ""):
        return error
    return RuntimeError(f"{root} (vLLM: {failure_line(error, '')})")


def failure_line(error: Exception, cause: str) -> str:
    """One line for telemetry and the shard's error: the first exception line that an engine core or one of its
    workers logged (the root cause; what follows it is often its consequence, such as a CUDA "illegal memory
    access" after a failed cuBLAS call, and C++ frames are never it); else the last error line it logged; else
    the exception's own line."""
    lines = [_untagged(line) for line in cause.splitlines() if "Error" in line and not _LOG_LEVEL.search(line)]
    lines = [line for line in lines if line and not line.startswith(("frame #", "terminate called"))]
    roots = [line for line in lines if _EXCEPTION_LINE.match(line) and not _WRAPPER.search(line)]
    if roots or lines:
        return (roots or lines)[0 if roots else -1][:500]
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[-1] if text else ''}"[:500]


# a vLLM log line below ERROR (its warnings name errors that did not happen)
_LOG_LEVEL = re.compile(r"\b(?:DEBUG|INFO|WARNING) \d\d-\d\d ")
# an exception's own line, as Python prints it: `RuntimeError: ...`, `torch.AcceleratorError: ...`
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception): \S")
# vLLM's own lines around a failed start, which name no cause of their own
_WRAPPER = re.compile(r"See root cause above|Engine core initialization failed|please check the stack trace above")


def _untagged(line: str) -> str:
    """A log line without its process tag (`(EngineCore pid=7) `, `(Worker_TP1 pid=9) `), vLLM's level, time
    and source (`ERROR 11-27 10:31:40 [core.py:1330] `) and torch's rank prefix (`[rank0]: `)."""
    line = re.sub(r"^\([^)]*\)\s*", "", line.strip())
    line = re.sub(r"^ERROR \d\d-\d\d [\d:]+ \[[^\]]*\]\s*", "", line)
    return re.sub(r"^\[rank\d+\]:\s*", "", line).strip()
