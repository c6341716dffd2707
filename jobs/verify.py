"""`raysweep verify OUTPUT [--samples N]`: generate a random sample of a finished sweep's rows again and
say how many outputs match what was committed.

The spec comes from the manifest (the path it was run from, checked against the hash it recorded), or
`--spec`. The sampled rows are read again from the task's data (the data's hash is checked too), written
to a data file of its own that keeps each row's sample id (so its seed is the same), and run as a sweep of
their own: the same models, engine arguments, sampling and `reproducible` setting, in shards of another
size and on new engines (a long-prompt task's chunked-prefill setting is planned from the sampled rows,
so it may differ from the sweep's). `--keep DIR` keeps those data files and that sweep's output in DIR; without
it they are in a temporary folder, removed when verify ends, and the run says so rather than print its path.
Each differing row is printed. Exit 1 when any row differs in a sweep run with `reproducible: true` (its outputs
must not depend on batches); without it the rate is reported, exit 0, as batch numerics may change a greedy
token where two are nearly tied. A team re-runs this after a new driver, vLLM or cluster to check that it
still gives the same answers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import tempfile

from cluster.contracts.errors import RaysweepError
from cluster.contracts.shard import GENERATED, ShardState
from jobs.ray_output import add_verbose_argument

ID_COLUMN = "_raysweep_sample_id"


class VerifyError(RaysweepError, ValueError):
    """The output cannot be verified as asked; the message says why."""


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output", help="a sweep's output (its manifest.json and results/)")
    parser.add_argument("--samples", type=int, default=200, help="rows to generate again (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="which rows: the random sample's seed")
    parser.add_argument("--spec", help="the spec the output was made from (default: the path its manifest records)")
    parser.add_argument("--address", help="Ray cluster (default: RAY_ADDRESS, else a new local Ray)")
    parser.add_argument("--keep", metavar="DIR", help="a new or empty folder to keep the rows generated again in "
                                                       "(their data and the verify sweep's output); default: "
                                                       "a temporary folder, removed when verify ends")
    add_verbose_argument(parser)


def verify(args: argparse.Namespace) -> int:
    if args.samples < 1:
        raise VerifyError(f"--samples {args.samples}: must be at least 1")
    if args.keep is not None and os.path.exists(args.keep) and (not os.path.isdir(args.keep) or os.listdir(args.keep)):
        raise VerifyError(f"--keep {args.keep}: not an empty folder; name a new one (nothing of yours is overwritten)")
    spec, manifest = _spec_made(args)
    mismatched = _check_files(args.output, manifest)  # the fast pass: every committed file is what was committed
    committed = _outputs(args.output, manifest, with_status=True)
    generated = {t.name for t in spec.tasks if t.replay is None}  # a replay task's outputs were read, not made
    candidates = [r for r in committed if r["status"] in GENERATED and r["task"] in generated]
    if not candidates:
        raise VerifyError(mismatched or f"{args.output}: no committed row with an output to verify")
    chosen = random.Random(args.seed).sample(candidates, min(args.samples, len(candidates)))
    with _folder(args.keep) as tmp:
        from cluster.store.manifest import read_manifest
        from jobs.interrupts import signalled
        from jobs.sweep import run_spec

        code = run_spec(_sweep_again(args, spec, manifest, chosen, tmp),
                        argparse.Namespace(output=None, address=args.address, max_attempts=3, dashboard=False,
                                           new_run=True, verbose=args.verbose),
                        output_kept=args.keep is not None, verifying=True)
        if code != 0 and signalled():  # stopped: its one line is said, and the output is unchanged
            return 1
        if code != 0:
            raise VerifyError("the verify sweep failed (its lines above say why)")
        again = os.path.join(tmp, "output")
        fresh = {_key(r): r["output"] for r in _outputs(again, read_manifest(again))}
    differ = [r for r in chosen if fresh.get(_key(r)) != r["output"]]
    for r in differ:
        completion = f"#{r['completion']}" if r["completion"] else ""
        print(f"[raysweep] verify: DIFFERS {r['model']}/{r['task']}/{r['sample_id']}{completion}: committed "
              f"{_clip(r['output'])}, now {_clip(fresh.get(_key(r)))}")
    reproducible = bool(manifest.get("reproducible"))
    print(f"[raysweep] verify: {len(chosen) - len(differ)} of {len(chosen)} sampled outputs match "
          f"({'reproducible: true' if reproducible else 'reproducible: false: batch numerics may move near-ties'})")
    if mismatched:
        print(f"[raysweep] verify: {mismatched}")
    return 1 if mismatched or (differ and reproducible) else 0


def _spec_made(args: argparse.Namespace):
    """(the spec the output was made from, the output's manifest): `--spec`, else the one its manifest records,
    its hash the manifest's."""
    from cluster.inputs.spec_file import load_spec
    from cluster.store.manifest import read_manifest

    try:
        manifest = read_manifest(args.output)
    except (OSError, ValueError) as e:
        raise VerifyError(f"{args.output}: no sweep output to verify here ({type(e).__name__}: {e})") from None
    source = args.spec or manifest.get("spec_source")
    if not source:
        raise VerifyError(f"{args.output}: its manifest does not record the spec it was made from: pass --spec")
    if args.spec and not os.path.exists(source):  # load_spec names what it is where it is something else
        raise VerifyError(f"--spec {source}: no such spec file")
    if not os.path.exists(source):  # e.g. a job's working dir, which Ray deleted after the job
        raise VerifyError(f"{source}: the spec {args.output} was made from is not there any more: pass --spec "
                          "with a copy of it")
    spec = load_spec(source)
    if spec.digest() != manifest.get("spec_hash"):
        raise VerifyError(f"{source}: not the spec {args.output} was made from (hash {spec.digest()}, the "
                          f"manifest's {manifest.get('spec_hash')}): pass --spec with that one")
    return spec, manifest


def _sweep_again(args: argparse.Namespace, spec, manifest: dict, chosen: list[dict], tmp: str):
    """The verify sweep: the chosen rows of each task written to `tmp`, their models, generated as the output was
    made (its target_delimiter); a task whose data changed since is refused."""
    from cluster.inputs.data import data_hashes, rows_with_ids
    from cluster.store.manifest import as_made

    recorded, now = manifest.get("data", {}), data_hashes(spec)
    tasks = {t.name: t for t in spec.tasks}
    new_tasks = []
    for name in sorted({r["task"] for r in chosen}):
        task = tasks[name]
        if recorded.get(name, {}).get("hash") not in (None, now[name]["hash"]):
            raise VerifyError(f"task {name}: its data ({now[name]['path']}) changed since {args.output} was "
                              "made: the rows cannot be generated again")
        ids = {r["sample_id"] for r in chosen if r["task"] == name}
        path = os.path.join(tmp, f"{name}.jsonl")
        with open(path, "w") as f:
            for sample_id, row in rows_with_ids(task, spec.data_path(task), ids):
                f.write(json.dumps({**row, ID_COLUMN: sample_id}, default=str) + "\n")
        new_tasks.append(dataclasses.replace(task, data=path, id_column=ID_COLUMN))
    models = tuple(m for m in spec.models if m.name in {r["model"] for r in chosen})
    again = dataclasses.replace(spec, name=f"{spec.name}-verify", output=os.path.join(tmp, "output"),
                                models=models, tasks=tuple(new_tasks))
    return as_made(again, manifest)


def _folder(keep: str | None):
    """Where the sampled rows and the verify sweep's output go: `--keep DIR` (checked new or empty), else a
    temporary folder removed at the end."""
    if keep is None:
        return tempfile.TemporaryDirectory(prefix="raysweep-verify-")
    os.makedirs(keep, exist_ok=True)
    return contextlib.nullcontext(os.path.abspath(keep))


def _check_files(output: str, manifest: dict) -> str | None:
    """Each committed shard's file against its manifest entry (rows, checksum), each mismatch printed. A file
    that is missing or unreadable stops verify (VerifyError), as does a file in results/ that the manifest did
    not commit (every reader of the folder reads it too); one that reads but is not what was committed is
    said at the end, after the rows are generated again. Returns that closing line, or None: all match."""
    from cluster.store.integrity import problems, stray_files, stray_line
    from cluster.store.output_files import filesystem

    fs, root = filesystem(output)
    found = problems(fs, root, manifest)
    strays = stray_files(fs, root, manifest)
    committed = sum(e.get("state") == ShardState.COMMITTED for e in manifest.get("shards", {}).values())
    for line in found + [stray_line(rel) for rel in strays]:
        print(f"[raysweep] verify: {line}")
    if strays:
        raise VerifyError(f"{output}: {len(strays)} file(s) in results/ that the manifest did not commit (listed "
                          f"above, first {strays[0]}): remove them or move them out of results/")
    if not found:
        print(f"[raysweep] verify: {committed} of {committed} committed results files match the manifest")
        return None
    what = (f"{len(found)} of {committed} committed results file(s) are not what was committed (listed above): "
            "restore them, or run the sweep again with --new-run")
    if any(line.endswith(" is missing") or " cannot be read " in line for line in found):
        raise VerifyError(what)
    return what


def _outputs(output: str, manifest: dict, with_status: bool = False) -> list[dict]:
    """Each committed row's key and output: its text, or for a loglikelihood row its choices' log-probabilities
    (as committed: a reproducible engine gives the same floats); none where nothing is committed. Read from the
    committed files, on the output's filesystem (a local folder whose name holds a colon is no URI). An output
    made before `completion` and the per-choice columns existed reads them as none."""
    import pyarrow.dataset as ds

    from cluster.store.output_files import filesystem, join

    fs, root = filesystem(output)
    files = sorted(join(root, e["file"]) for e in manifest["shards"].values() if e["state"] == ShardState.COMMITTED)
    if not files:
        return []
    dataset = ds.dataset(files, filesystem=fs, format="parquet")
    wanted = ["model", "task", "sample_id", "output_text", "completion", "choice_logprobs"] + ["status"] * with_status
    have = set(dataset.schema.names)
    rows = dataset.to_table(columns=[c for c in wanted if c in have]).to_pylist()
    for r in rows:
        logprobs = r.pop("choice_logprobs", None)
        r["output"] = tuple(logprobs) if logprobs is not None else r.pop("output_text")
        r["completion"] = r.get("completion") or 0
    return rows


def _key(row: dict) -> tuple:
    return row["model"], row["task"], row["sample_id"], row["completion"]


def _clip(text, n: int = 60) -> str:
    if text is None:
        return "nothing"
    if not isinstance(text, str):
        text = ", ".join(f"{x:.4f}" for x in text)  # a loglikelihood row's choices
    return repr(text if len(text) <= n else text[:n] + "…")
