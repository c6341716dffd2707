"""What the bench parts share: synthetic prompts, the `Bench` that records figures, and whole-process runs.

`prompts_of` makes the seeded synthetic prompts every part uses. `Bench` holds one run's model, out folder
and figures (`record`, `save`: OUT/bench.parquet and a markdown table) and builds raw `vllm.LLM` engines
with raysweep's arguments. The rest starts and times child processes for the whole-process parts (e, w, r):
`run_process`, the sweep spec they run (`sweep_spec`), the vLLM arguments the plain scripts get
(`vllm_args`), and readers of what the children leave behind.
"""

from __future__ import annotations

import gc
import json
import os
import random
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]  # children run from the repository's root (benchmarks/ is not installed)
WORDS = ("the of and to in is was for on that with as by at from his her they this had are but not one "
         "river market signal engine winter garden letter number paper stone").split()
SHARD_SAMPLES = 256

# (argv, extra environment, path stem for its logs) -> (wall seconds, stdout); raises if the child failed
Runner = Callable[[list[str], dict[str, str], Path], tuple[float, str]]


def prompts_of(n: int, lo: int, hi: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target, words = rng.randint(lo, hi), []
        while sum(len(w) + 1 for w in words) < target:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words)[:target])
    return out


class Bench:
    def __init__(self, model_path: str, out: Path, n_prompts: int):
        self.model_path, self.out, self.n = model_path, out, n_prompts
        self.rows: list[dict] = []
        self.engine_overrides: dict = {}
        self.prompts = prompts_of(n_prompts, 32, 1024, seed=1)

    def record(self, part: str, metric: str, value, unit: str = "") -> None:
        self.rows.append({"part": part, "metric": metric, "value": None if value is None else float(value), "unit": unit})
        print(f"[bench] {part} {metric} = {value} {unit}", flush=True)

    # -- engines -----------------------------------------------------------------------------------
    def llm(self, **overrides):
        from vllm import LLM

        from actors.engine import EngineProfile
        from actors.vllm_args import engine_args
        from cluster.contracts.spec import ModelSpec

        profile = overrides.pop("profile", EngineProfile())
        engine = {**self.engine_overrides, **overrides.pop("engine", {})}
        args = engine_args(ModelSpec("bench", self.model_path, engine=engine),
                           self.model_path, profile, 1.0)
        args.update(overrides)
        return LLM(**args)

    @staticmethod
    def free(llm) -> None:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()

    @staticmethod
    def timed_generate(llm, prompts, params) -> tuple[float, int, list]:
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        return wall, sum(len(o.outputs[0].token_ids) for o in outs), outs

    def token_prompts(self, llm, texts):
        tok = llm.get_tokenizer()
        return [{"prompt_token_ids": tok(t)["input_ids"]} for t in texts]

    def save(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self.out / "bench.parquet"
        schema = pa.schema([("part", pa.string()), ("metric", pa.string()), ("value", pa.float64()),
                            ("unit", pa.string())])
        table = pa.Table.from_pylist(self.rows, schema=schema)
        if path.exists():  # an earlier run's rows (one whose values were all null typed them null)
            table = pa.concat_tables([pq.read_table(path).cast(schema), table])
        pq.write_table(table, path)
        print("\n| part | metric | value | unit |\n|---|---|---:|---|")
        for r in self.rows:
            value = "" if r["value"] is None else f"{r['value']:.3f}" if abs(r["value"]) < 100 else f"{r['value']:.0f}"
            print(f"| {r['part']} | {r['metric']} | {value} | {r['unit']} |")


# -- whole processes (parts e, w, r) -----------------------------------------------------------------
def sweep_spec(name: str, output: Path, models: list, tasks: list, overrides: dict, max_tokens: int,
               actors: dict) -> dict:
    """A raysweep spec: models [(name, path)] x tasks [(name, JSONL file of {"id", "text"})]."""
    return {
        "name": name, "output": str(output),
        "models": [{"name": m, "path": p, "engine": {"backend": "vllm", **overrides}} for m, p in models],
        # chunked prefill off: every shard runs the short profile, whose vLLM arguments the baselines get
        "tasks": [{"name": t, "data": str(f), "id_column": "id", "prompt": "{text}", "chunked_prefill": "off",
                   "sampling": {"max_tokens": max_tokens, "temperature": 0}} for t, f in tasks],
        "shards": {"max_samples": SHARD_SAMPLES}, **({"actors": dict(actors)} if actors else {})}  # none: chosen


def vllm_args(model_path: str, overrides: dict) -> dict:
    """What raysweep gives `vllm.LLM` for a short shard with a whole GPU."""
    from actors.engine import EngineProfile
    from actors.vllm_args import engine_args
    from cluster.contracts.spec import ModelSpec

    return engine_args(ModelSpec("bench", model_path, engine=dict(overrides)), model_path, EngineProfile(), 1.0)


def write_prompts(path: Path, texts: list) -> Path:
    with open(path, "w") as f:
        f.writelines(json.dumps({"id": f"p{i:05d}", "text": t}) + "\n" for i, t in enumerate(texts))
    return path


def summary_line(stdout: str) -> dict | None:
    """The script's JSON summary: its last stdout line that is a JSON object with `outputs` (vLLM may log
    to stdout after it, at shutdown)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                found = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(found, dict) and "outputs" in found:
                return found
    return None


def count_lines(path: Path) -> int:
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def fresh_caches(folder: Path) -> dict[str, str]:
    """The environment that points every compile cache of a process and its children at empty folders under
    `folder` (emptied first): vLLM's root (its torch.compile artefacts), Inductor's, Triton's and FlashInfer's JIT
    workspace, each where the library reads its own variable: a node new to the model and to vLLM."""
    shutil.rmtree(folder, ignore_errors=True)
    env = {"VLLM_CACHE_ROOT": folder / "vllm", "TORCHINDUCTOR_CACHE_DIR": folder / "inductor",
           "TRITON_CACHE_DIR": folder / "triton", "FLASHINFER_WORKSPACE_BASE": folder / "flashinfer"}
    for path in env.values():
        path.mkdir(parents=True)
    return {key: str(path) for key, path in env.items()}


def run_process(argv: list[str], env: dict[str, str], stem: Path) -> tuple[float, str]:
    """Run one child to its exit: wall seconds from just before its start to just after its exit, and its
    stdout. Its stdout and stderr go to files beside `stem`; a non-zero exit raises with stderr's tail."""
    stem.with_name(stem.name + ".cmd").write_text(
        " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv) + "\n")
    # unbuffered: a child's log lines reach its files in order and in full, even if it is killed
    child_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    out, err = stem.with_name(stem.name + ".stdout"), stem.with_name(stem.name + ".stderr")
    with open(out, "w") as stdout, open(err, "w") as stderr:
        started = time.perf_counter()
        code = subprocess.run(argv, stdout=stdout, stderr=stderr, env=child_env, cwd=REPO).returncode
        wall = time.perf_counter() - started
    if code != 0:
        tail = err.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{stem.name}: {shlex.join(argv[:3])} exited {code}; its stderr ends:\n{tail}")
    return wall, out.read_text()


def result_counts(output: Path) -> tuple[int, int]:
    """Rows and output tokens in a sweep's committed result files."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    rows = tokens = 0
    for path in (output / "results").rglob("*.parquet"):
        if not path.name.startswith("."):  # a temporary file of an uncommitted shard
            table = pq.read_table(path, columns=["output_tokens"])
            rows, tokens = rows + table.num_rows, tokens + (pc.sum(table["output_tokens"]).as_py() or 0)
    return rows, tokens


# telemetry/actors.parquet's seconds of each engine start, step by step (cluster/contracts/telemetry_schema.py)
ENGINE_START_COLUMNS = ("process_s", "imports_s", "engine_init_s", "weights_s", "core_init_s", "compile_s",
                        "profile_run_s", "graph_capture_s", "warmup_s", "first_token_s", "startup_s")


def engine_starts(output: Path) -> dict[str, list[float]]:
    """Each measured column of ENGINE_START_COLUMNS over a sweep's engine starts, in their order; a column no
    start measured (an engine without it, an output from before it) is left out."""
    import pyarrow.parquet as pq

    path = output / "telemetry" / "actors.parquet"
    table = pq.read_table(path) if path.exists() else None
    found = {}
    for column in ENGINE_START_COLUMNS:
        values = [v for v in table[column].to_pylist() if v is not None] \
            if table is not None and column in table.column_names else []
        if values:
            found[column] = values
    return found


def engine_lives(output: Path) -> list[str]:
    """Each engine start of a sweep, in order, as one line: its actor, model, why it started, its profile, its
    start-up and compile seconds, and the shards of each model that ran on it (from telemetry/shards.parquet: a
    shard ran on its actor's last engine ready when it started)."""
    import pyarrow.parquet as pq

    starts, shards = (output / "telemetry" / f"{name}.parquet" for name in ("actors", "shards"))
    if not starts.exists():
        return []
    rows = pq.read_table(starts).to_pylist()
    ready = sorted((row["ready_at"], row["actor_id"], row["start_index"]) for row in rows if row.get("ready_at"))
    ran: dict[tuple, dict[str, int]] = {}
    for shard in pq.read_table(shards).to_pylist() if shards.exists() else []:
        if shard.get("error") is None and shard.get("started_at") is not None:
            engine = [index for at, actor, index in ready if actor == shard["actor_id"] and at <= shard["started_at"]]
            models = ran.setdefault((shard["actor_id"], engine[-1] if engine else None), {})
            models[shard["model"]] = models.get(shard["model"], 0) + 1
    lines = []
    for row in rows:
        def seconds(key: str) -> str:
            return "-" if row.get(key) is None else f"{row[key]:.1f}"
        lines.append(f"{row['actor_id'][:8]} #{row['start_index']} {row['model']} ({row['reason']}, {row['profile']}): "
                     f"up in {seconds('startup_s')} s, compile {seconds('compile_s')} s, "
                     f"weights {seconds('weights_s')} s;"
                     f" shards {ran.get((row['actor_id'], row['start_index']), {})}")
    return lines
