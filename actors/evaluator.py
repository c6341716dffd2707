"""EvalActor: one engine (one model, one profile) that turns shards into result tables.

The class is plain Python; the scheduler wraps it with `ray.remote` and the resources from the spec, so
tests can also drive it directly. Each call returns the shard's results as an Arrow table and one
telemetry row (DESIGN §5, telemetry/shards); figures that are not measured here are None.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone

import pyarrow as pa

from actors.engine import EngineProfile, GenRequest, make_engine
from cluster.planner import Shard
from cluster.spec import ModelSpec, TaskSpec

RESULT_SCHEMA = pa.schema([
    ("sample_id", pa.string()), ("output_text", pa.string()), ("output_tokens", pa.int32()),
    ("finish_reason", pa.string()), ("status", pa.string()), ("latency_s", pa.float64()),
    ("ttft_s", pa.float64()), ("error", pa.string()),
])


class EvalActor:
    def __init__(self, model: ModelSpec, model_path: str, profile: EngineProfile, num_cpus: float = 1):
        self.model = model
        self.actor_id, self.node_ip = _identity()
        self.engine = make_engine(model, model_path, profile, num_threads=max(1, int(num_cpus)))
        self.gpu_name = _gpu_name()

    def startup(self) -> dict:
        """The telemetry/actors row for this engine start."""
        return {"actor_id": self.actor_id, "node_ip": self.node_ip, "gpu_name": self.gpu_name,
                "model": self.model.name, "engine": self.engine.kind, "profile": self.engine.profile.name,
                **self.engine.startup()}

    def run_shard(self, shard: Shard, task: TaskSpec, attempt: int) -> tuple[pa.Table, dict]:
        started_at, started = datetime.now(timezone.utc), time.perf_counter()
        rows = shard.rows.to_pylist()
        runnable = [r for r in rows if r["status"] != "skipped"]
        requests = [GenRequest(r["sample_id"], r["prompt_token_ids"], r["seed"]) for r in runnable]
        generated = {g.sample_id: g for g in self.engine.generate(requests, task.sampling, task.structured)}
        wall = time.perf_counter() - started
        out = []
        for r in rows:
            g = generated.get(r["sample_id"])
            out.append({"sample_id": r["sample_id"], "status": r["status"], "error": None,
                        "output_text": g.output_text if g else None, "output_tokens": g.output_tokens if g else None,
                        "finish_reason": g.finish_reason if g else None, "latency_s": g.latency_s if g else None,
                        "ttft_s": g.ttft_s if g else None})
        output_tokens = sum(g.output_tokens for g in generated.values())
        telemetry = {
            "shard_id": shard.shard_id, "attempt": attempt, "actor_id": self.actor_id, "node_ip": self.node_ip,
            "gpu_name": self.gpu_name, "engine": self.engine.kind,
            "cuda_graphs": self.engine.startup()["cuda_graphs"], "profile": shard.profile,
            "chunked_prefill": self.engine.profile.chunked_prefill,
            "max_num_batched_tokens": self.engine.profile.max_num_batched_tokens,
            "n_samples": len(rows), "prompt_tokens": int(sum(r["prompt_tokens"] for r in runnable)),
            "output_tokens": output_tokens, "wall_s": wall,
            "output_tok_per_s": output_tokens / wall if wall > 0 else None,
            "gpu_mem_used_max_mib": None, "gpu_util_mean_pct": None, "power_mean_w": None,  # NVML: telemetry issue
            "started_at": started_at, "finished_at": datetime.now(timezone.utc), "error": None,
        }
        return pa.Table.from_pylist(out, schema=RESULT_SCHEMA), telemetry

    def exit(self) -> None:
        """Test hook for a hard actor death (as a crashed engine would)."""
        os._exit(1)


def _identity() -> tuple[str, str | None]:
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            return ctx.get_actor_id() or f"driver-{os.getpid()}", ray.util.get_node_ip_address()
    except ImportError:
        pass
    return f"local-{os.getpid()}", None


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        return None
