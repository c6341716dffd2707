"""What vLLM needs to know of a model's class, found in the engine's own process rather than in a new one.

vLLM 0.26 learns what a model class supports (`_ModelInfo`: pipeline parallel, multimodal, ...) as `LLM(...)` builds
its `ModelConfig` (`vllm/config/model.py` -> `registry.inspect_model_cls`). Unless `VLLM_CACHE_ROOT/modelinfos` holds
the class's entry, `vllm/model_executor/models/registry.py` finds it by starting a new Python process
(`_run_in_subprocess`) that imports vLLM and the class, so as not to start CUDA in the caller. On a node new to vLLM
every engine start pays for that fresh interpreter: on an H200 with every cache empty, 23 s went by between vLLM
logging `builtin:tiny`'s arguments and resolving its architecture, out of a 67.5 s construction; with the cache
holding the class, the two lines carry the same second (bench/records/h200-engine-start-steps.md).

An engine's process has imported vLLM already, and importing a model class starts no CUDA, so `inspect_here` asks
vLLM's registry for the model's architectures in this process, with vLLM's subprocess step run as a plain call for
that moment: vLLM's own code then writes its cache entry, which `LLM(...)` reads a moment later. Anything that does not
go as planned (a hub id with no local config.json, a registry whose private names moved, an inspection that raised)
leaves vLLM to do it its own way; nothing is raised, and the last two are said in one line.
"""

from __future__ import annotations

import json
import os
import sys


def inspect_here(model_path: str) -> list[str]:
    """The architectures of the model at `model_path` that vLLM's registry inspected in this process (its
    config.json's `architectures`); [] where none was (no local config.json, not a class vLLM's registry names,
    or its private names not as vLLM 0.26 has them)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            architectures = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []
    try:
        from vllm.model_executor.models import registry
        from vllm.plugins import load_general_plugins
    except ImportError:  # no vLLM here: nothing to inspect
        return []
    try:
        in_subprocess = registry._run_in_subprocess
        models = registry.ModelRegistry.models
    except AttributeError as e:
        print(f"[raysweep] vLLM's model registry is not as vLLM 0.26 has it ({e}); vLLM inspects {architectures} in "
              "a process of its own", file=sys.stderr)
        return []
    load_general_plugins()  # as vLLM's subprocess step does first (registry.py `_run`); LLM(...) loads them too
    registry._run_in_subprocess = _call
    inspected = []
    try:
        for arch in architectures:
            if arch in models and registry.ModelRegistry._try_inspect_model_cls(arch) is not None:
                inspected.append(arch)
    except Exception as e:  # noqa: BLE001  (vLLM's own subprocess step runs at LLM(...) instead)
        print(f"[raysweep] vLLM's model registry could not inspect {architectures} in this process "
              f"({type(e).__name__}: {e}); vLLM inspects it in a process of its own", file=sys.stderr)
    finally:
        registry._run_in_subprocess = in_subprocess
    return inspected


def _call(fn):
    """vLLM's `_run_in_subprocess(fn)`, run here: `fn()`."""
    return fn()
