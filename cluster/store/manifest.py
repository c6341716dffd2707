"""The manifest of an output (docs/design.md, Output): the shards and their states (cluster/contracts/shard.py ShardState),
the runs, and the checks a resume passes before it adds to an output.

A shard is recorded once its results file is in place. On a local disk the record is one line appended to
manifest.journal (flushed; a torn last line from a crash is ignored), and manifest.json, replaced
atomically, takes the journal in when the plan is recorded and when the sweep finishes: a commit costs the
same at the 4,000th shard as at the first. Object stores cannot append, so there manifest.json is replaced
on every commit. `read_manifest` merges both.

Re-running the same spec into the same output skips committed shards; a different spec into it is refused,
as are results made under another reproducible setting or from changed data, and an output that is not a
sweep's (`refuse_foreign`).
"""

from __future__ import annotations

import dataclasses

import json
import os
import platform
import uuid
from datetime import datetime, timezone

import pyarrow.fs as pafs

from cluster.contracts.results_schema import RESULT_SCHEMA
from cluster.contracts.shard import ShardState
from cluster.contracts.spec import SweepSpec
from cluster.store.output_files import SinkError, filesystem, join, result_file, write_bytes

# what `reproducible: true` runs (actors/vllm_engine.py REPRODUCIBLE_ARGS; the CPU engine runs one row at a
# time), kept in the manifest: a resume adds to reproducible results only under the same setting. It changes
# with REPRODUCIBLE_ARGS.
REPRODUCIBLE_SETTING = ("vLLM batch-invariant mode with TRITON_ATTN, no prefix caching, no chunked prefill, CUDA "
                        "graphs and torch.compile on; the CPU engine's log-likelihoods as lm-eval's hf model at batch "
                        "size 1 (a continuation's last token not fed)")
# the setting before the CPU engine matched lm-eval's hf inputs: its log-likelihoods differ by float32 steps
EARLIER_REPRODUCIBLE_SETTING = ("vLLM batch-invariant mode with TRITON_ATTN, no prefix caching, no chunked prefill, "
                                "CUDA graphs and torch.compile on")

JOURNAL = "manifest.journal"


def is_committed(entry: dict) -> bool:
    return entry.get("state") == ShardState.COMMITTED


def refuse_foreign(fs: pafs.FileSystem, root: str, output: str) -> None:
    """An output with results/, or telemetry/ holding more than a killed run's telemetry/.pending, but no
    manifest.json is not a sweep's (a sweep saves its manifest before its first result), nor is one whose
    manifest.json is not raysweep's (not JSON, no `shards` mapping: `read_manifest` says which): nothing is
    written beside those folders, and `--new-run` deletes nothing there."""
    if fs.get_file_info(join(root, "manifest.json")).type != pafs.FileType.NotFound:
        _manifest_json(fs, root, output)
        return
    for rel in ("results", "telemetry"):
        if fs.get_file_info(join(root, rel)).type != pafs.FileType.Directory:
            continue
        entries = fs.get_file_info(pafs.FileSelector(join(root, rel)))
        if rel == "results" or any(e.base_name != ".pending" for e in entries):
            raise SinkError(f"output {output}: holds {rel}/ but no manifest.json, so it is not a raysweep "
                            "output; nothing was changed there: choose another output")


def discard_earlier_run(fs: pafs.FileSystem, root: str) -> None:
    """`--new-run`: the earlier run's results, telemetry, lm-eval's files, manifest, summary and report go."""
    for rel in ("results", "telemetry", "lm_eval"):
        if fs.get_file_info(join(root, rel)).type == pafs.FileType.Directory:
            fs.delete_dir(join(root, rel))
    for rel in ("manifest.json", JOURNAL, "summary.parquet", "report.html"):
        if fs.get_file_info(join(root, rel)).type == pafs.FileType.File:
            fs.delete_file(join(root, rel))


def load_manifest(fs: pafs.FileSystem, root: str, output: str, spec: SweepSpec, data_hashes: dict) -> dict:
    """The manifest this run goes on with: a fresh one, or the output's after the resume checks (the same
    spec, reproducible setting, layout and data as its committed results)."""
    digest = spec.digest()
    if fs.get_file_info(join(root, "manifest.json")).type == pafs.FileType.NotFound:
        return fresh_manifest(spec, data_hashes, digest)
    manifest = read_manifest(output)
    any_committed = any(is_committed(e) for e in manifest["shards"].values())
    made = bool(manifest.get("reproducible"))
    if made != spec.reproducible and any_committed:
        raise SinkError(f"output {output} holds results made with reproducible: {str(made).lower()}; this "
                        f"spec says reproducible: {str(spec.reproducible).lower()}, and one output never "
                        "mixes the two: use a new output, or --new-run to discard them")
    setting = manifest.get("reproducible_setting")
    if made and spec.reproducible and setting != REPRODUCIBLE_SETTING and any_committed:
        raise SinkError(f"output {output} holds reproducible results made with another setting "
                        f"({setting or 'one from before settings were recorded'}); this raysweep runs "
                        f"{REPRODUCIBLE_SETTING}, and one output never mixes the two: use a new output, or "
                        "--new-run to discard them")
    if manifest.get("spec_hash") not in (digest, spec.digest(with_placement=True)) and not any_committed:
        # another spec's run that committed nothing (refused or failed early): nothing to keep apart
        return dict(fresh_manifest(spec, data_hashes, digest), runs=manifest.get("runs", []))
    if manifest.get("spec_hash") not in (digest, spec.digest(with_placement=True)):
        raise SinkError(f"output {output} holds results of another spec{_what_changed(manifest, spec)} (hash "
                        f"{manifest.get('spec_hash')}, this one is {digest}); use a new output, or --new-run to "
                        "discard them")
    old = next((e["file"] for e in manifest["shards"].values()
                if is_committed(e) and "/model=" in f"/{e.get('file', '')}"), None)
    if old is not None:
        raise SinkError(f"output {output} holds results in an earlier raysweep's layout ({old}); this one "
                        "writes results/<model>/<task>/ and cannot add to them: use a new output, or --new-run "
                        "to discard them")
    _check_data(output, manifest, data_hashes)
    manifest["spec_hash"] = digest
    manifest.update(spec_parts=spec.digest_parts(), reproducible=spec.reproducible, spec_source=_spec_source(spec),
                    reproducible_setting=REPRODUCIBLE_SETTING if spec.reproducible else None)
    return manifest


def _check_data(output: str, manifest: dict, data_hashes: dict) -> None:
    """Results planned from other data are never mixed in: a task's data hash must match the one its
    committed results were made from; where nothing of it is committed, the new hash is recorded."""
    recorded = manifest.setdefault("data", {})
    committed = {sid.split("/")[1] for sid, entry in manifest["shards"].items() if is_committed(entry)}
    for task, now in data_hashes.items():
        before = recorded.get(task)
        if before is not None and before["hash"] != now["hash"] and task in committed:
            raise SinkError(f"output {output}: the data of task {task} ({now['path']}) changed since the "
                            f"results there were made from it; restore it, or --new-run to discard them")
        if before is not None and task in committed and None not in (before.get("documents"), now.get("documents")) \
                and before["documents"] != now["documents"]:
            raise SinkError(f"output {output}: the documents of lm-eval task {task} (its data or its template) changed "
                            "since the results there were made from them; restore them, or --new-run to discard them")
        # nothing committed from the old data (or an output from before data was recorded): the new holds
        recorded[task] = now


# in the manifests of outputs made since loglikelihood tasks had a target_delimiter (lm-eval's default " ")
DELIMITER_DEFAULT = "target_delimiter_default"
# how many committed shards the summary.parquet that `finish` wrote was made from: a summary that counts fewer is
# older than the output's last commits (a run killed between them and its summary); none in outputs made before
SUMMARIZED = "summary_shards"
# "<model>/<task>" -> how many shards its plan has, recorded with the plan: an output is complete when each pair has
# exactly that many entries, all committed (an entry the plan lacks is another plan's); none in outputs made before
PLANNED = "planned_shards"


def as_made(spec: SweepSpec, manifest: dict) -> SweepSpec:
    """The spec as this output's results were made: an output made before loglikelihood tasks had a
    target_delimiter was made with none, so its tasks that leave it out go on with "" (their spec hash is
    the same either way: a default is not hashed), and resumed shards score what the first ones scored."""
    if manifest.get(DELIMITER_DEFAULT) is not None:
        return spec
    tasks = tuple(dataclasses.replace(t, target_delimiter="") if t.loglikelihood and t.target_delimiter is None
                  else t for t in spec.tasks)
    return dataclasses.replace(spec, tasks=tasks)


def fresh_manifest(spec: SweepSpec, data_hashes: dict, digest: str) -> dict:
    return {"sweep": spec.name, "spec_hash": digest, "spec_parts": spec.digest_parts(), "created_at": now(),
            "versions": _versions(),
            DELIMITER_DEFAULT: " ",
            "shards": {}, "data": data_hashes, "reproducible": spec.reproducible,
            "reproducible_setting": REPRODUCIBLE_SETTING if spec.reproducible else None,
            "results_columns": list(RESULT_SCHEMA.names), "spec_source": _spec_source(spec)}


class ManifestWriter:
    """Writes one output's manifest: `record` a shard's entry (a journal line on a local disk, the whole
    manifest.json on an object store), `save` the whole state."""

    def __init__(self, fs: pafs.FileSystem, root: str):
        self.fs, self.root = fs, root
        self.journal = None  # append handle of manifest.journal (local outputs)

    def record(self, manifest: dict, shard_id: str, entry: dict) -> None:
        manifest["shards"][shard_id] = entry
        if not isinstance(self.fs, pafs.LocalFileSystem):
            self.save(manifest)
            return
        if self.journal is None:
            self.journal = open(join(self.root, JOURNAL), "a", encoding="utf-8")
            self.journal.write("\n")  # ends a line a killed writer may have torn; empty lines are skipped
        self.journal.write(json.dumps({"shard_id": shard_id, **entry}, sort_keys=True) + "\n")
        self.journal.flush()  # in the OS once written: a killed driver loses nothing it recorded

    def save(self, manifest: dict) -> None:
        """Replace manifest.json with the whole state; the journal's lines are in it now, so it is emptied
        (a crash between the two leaves lines that repeat what manifest.json says: harmless)."""
        tmp = join(self.root, f".manifest.{uuid.uuid4().hex[:8]}.tmp")
        write_bytes(self.fs, tmp, json.dumps(manifest, indent=1, sort_keys=True).encode())
        self.fs.move(tmp, join(self.root, "manifest.json"))
        if isinstance(self.fs, pafs.LocalFileSystem):
            self.close()
            if os.path.exists(join(self.root, JOURNAL)):
                os.remove(join(self.root, JOURNAL))

    def close(self) -> None:
        if self.journal is not None:
            journal, self.journal = self.journal, None
            try:
                journal.close()
            except OSError:
                # the flush of the one line whose `record` already raised (the disk full): that shard was never
                # committed, and a torn last line is skipped when the journal is read, so nothing is lost; the
                # run's own error (OutputWriteError) stays the one line said, without this one chained to it
                pass


def _manifest_json(fs: pafs.FileSystem, base: str, output: str) -> dict:
    """manifest.json as raysweep writes it: a JSON object with a `shards` mapping (FileNotFoundError where there is
    none). Else SinkError: a file of that name that is not raysweep's is nobody's to replace, so no `--new-run`."""
    if fs.get_file_info(f"{base}/manifest.json").type not in (pafs.FileType.File, pafs.FileType.NotFound):
        raise SinkError(f"output {output}: manifest.json: {base}/manifest.json is not a file, so not a raysweep "
                        "manifest; restore it, or choose another output")
    with fs.open_input_stream(f"{base}/manifest.json") as f:
        try:
            manifest = json.loads(f.read())
        except (ValueError, RecursionError) as e:
            raise SinkError(f"output {output}: manifest.json: unreadable, not a raysweep manifest (not JSON: "
                            f"{str(e)[:200]}); nothing was changed there: restore it, or choose another output") \
                from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), dict):
        raise SinkError(f"output {output}: manifest.json: no `shards` mapping, so not a raysweep manifest; nothing "
                        "was changed there: restore it, or choose another output")
    return manifest


def read_manifest(output: str) -> dict:
    """The manifest of an output: manifest.json with the commits journaled after it applied in order
    (a torn last line, from a driver killed mid-write, is skipped). Raises FileNotFoundError if absent, and
    SinkError naming the file where it is not a manifest raysweep wrote (`[]`, a shard without a state,
    a journal line that is not a shard's entry)."""
    fs, root = filesystem(output)
    base = f"{root.rstrip('/')}"
    manifest = _manifest_json(fs, base, output)
    shards = manifest["shards"]
    if fs.get_file_info(f"{base}/{JOURNAL}").type == pafs.FileType.File:
        with fs.open_input_stream(f"{base}/{JOURNAL}") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
        for n, line in enumerate(lines, 1):
            try:
                entry = json.loads(line)
            except (ValueError, RecursionError):  # empty, or torn by a driver killed mid-write: skipped
                continue
            if not isinstance(entry, dict) or not isinstance(entry.get("shard_id"), str):
                raise SinkError(f"output {output}: {JOURNAL}:{n}: not a shard's entry (no shard_id); restore "
                                "the journal, or --new-run to start the output again")
            shards[entry.pop("shard_id")] = entry
    data = manifest.get("data", {})
    for task, entry in data.items() if isinstance(data, dict) else [(None, data)]:
        if not isinstance(entry, dict) or not isinstance(entry.get("hash"), str):
            raise SinkError(f"output {output}: manifest.json: {'data' if task is None else f'data.{task}'}: not "
                            f"{'a mapping of task to data file' if task is None else 'a data file and its hash'} "
                            f"(it is {json.dumps(entry)[:60]}); restore the manifest, or --new-run to start the "
                            "output again")
    states = {s.value for s in ShardState}
    for sid, entry in shards.items():
        model, task, index = _parts(sid)
        if index is None:
            raise SinkError(f"output {output}: manifest: shard {sid!r}: not a shard id raysweep writes "
                            "(<model>/<task>/<index>); restore the manifest, or --new-run to start the output again")
        if not isinstance(entry, dict) or entry.get("state") not in states:
            raise SinkError(f"output {output}: manifest.json: shard {sid}: no state of {', '.join(sorted(states))}; "
                            "restore the manifest, or --new-run to start the output again")
        if entry["state"] == ShardState.COMMITTED and not (isinstance(entry.get("file"), str) and entry["file"]):
            raise SinkError(f"output {output}: manifest.json: shard {sid}: committed without the path of its results "
                            "file; restore the manifest, or --new-run to start the output again")
        rows = entry.get("rows")
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
            raise SinkError(f"output {output}: manifest: shard {sid}: rows {json.dumps(rows)[:40]} is not a count of "
                            "rows; restore the manifest, or --new-run to start the output again")
        if entry["state"] == ShardState.COMMITTED and entry["file"] not in _files_of(model, task, index):
            raise SinkError(f"output {output}: manifest: shard {sid}: committed as {entry['file']}, not its own "
                            f"results file {result_file(model, task, index)}; restore the manifest, or --new-run to "
                            "start the output again")
    if not isinstance(manifest.get("versions", {}), dict):
        raise SinkError(f"output {output}: manifest.json: `versions` is not a mapping of package to version; restore "
                        "the manifest, or --new-run to start the output again")
    return manifest


def _what_changed(manifest: dict, spec: SweepSpec) -> str:
    """`: tasks.qa changed, tasks.extra added` from the parts of the spec the output recorded (none recorded by
    outputs made before: nothing said)."""
    before, now_ = manifest.get("spec_parts"), spec.digest_parts()
    if not isinstance(before, dict):
        return ""
    said = []
    for key in sorted(set(before) | set(now_)):
        item = ".".join(key.split(".")[:2])  # tasks.qa of tasks.qa.prompt: one added or removed whole is said so
        gone, new = (item != key and not any(k.startswith(f"{item}.") for k in parts)
                     for parts in (now_, before))
        line = f"{item} added" if new else f"{item} removed" if gone else f"{key} changed"
        if before.get(key) != now_.get(key) and line not in said:
            said.append(line)
    return f": {', '.join(said[:4])}{f' and {len(said) - 4} more' if len(said) > 4 else ''}" if said else ""


def _parts(shard_id: str) -> tuple[str, str, int | None]:
    """A shard id's model, task and index (cluster/plan/planner.py names shards so); index None where it is not one."""
    parts = shard_id.split("/")
    if len(parts) != 3 or not all(parts) or not parts[2].isdigit() or "=" in parts[0] + parts[1]:
        return "", "", None
    return parts[0], parts[1], int(parts[2])


def _files_of(model: str, task: str, index: int) -> tuple[str, str]:
    """Where a shard's results file lies: the layout's, or an earlier raysweep's (results/model=M/task=T/)."""
    own = result_file(model, task, index)
    return own, f"results/model={model}/task={task}/{own.rsplit('/', 1)[1]}"


def _spec_source(spec: SweepSpec) -> str | None:
    """The spec file's absolute path (`raysweep verify` reads it again), where it came from a file."""
    return os.path.abspath(spec.source) if os.path.isfile(spec.source) else None


def _versions() -> dict:
    import importlib.metadata as md

    versions = {"python": platform.python_version()}
    for dist in ("raysweep", "ray", "pyarrow", "transformers", "torch", "xgrammar", "vllm"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return versions


def now() -> str:
    return datetime.now(timezone.utc).isoformat()
