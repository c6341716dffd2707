"""The output's disk filling up mid-run (a 60 KiB tmpfs as the output): one line naming the cause, exit 1, what
was committed kept, no temporary file left; once there is room, the same command resumes to every sample
exactly once (not two or three chained OSErrors, and no .tmp file left forever)."""

import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from tests.conftest import LEAN_EXTRACT_ROWS, ROOT, lean_quickstart
from tests.test_reliability import wait_for


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=60k", "tmpfs", str(disk)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"no small filesystem can be made here (mount -t tmpfs: {made.stderr.strip()})")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _sweep(spec, out, ray) -> subprocess.CompletedProcess:
    """The command, joined to the session's local Ray (`ray`, tests/conftest.py ray_local): what fills here is the
    output's disk, not Ray's, and a local Ray of its own for each of the two runs was two starts of Ray (with its
    reaper and early engine host) on the 2-core CI machine. A command's own local Ray is tested where it is the
    point (tests/test_signals.py, tests/test_reliability.py's kill -9, tests/test_sweep.py's quickstart)."""
    return subprocess.run([sys.executable, "-m", "jobs.sweep", str(spec), "--output", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PYTHONUNBUFFERED": "1",
                                            "RAY_ADDRESS": ray.get_runtime_context().gcs_address})


@pytest.mark.slow
def test_a_full_disk_mid_run_is_one_line_and_the_same_command_resumes_once_there_is_room(small_disk, tmp_path,
                                                                                       ray_local):
    out = small_disk / "out"
    # its output over 100 KiB: the 60 KiB disk fills mid-run. A name of its own on the session's Ray, whose
    # metrics endpoint tests/test_metrics.py reads by sweep name
    spec = lean_quickstart(tmp_path, "full-disk")
    full = _sweep(spec, out, ray_local)
    assert full.returncode == 1, full.stdout[-2000:] + full.stderr[-2000:]
    ours = [line for line in full.stderr.splitlines() if line.startswith("raysweep:")]  # beside Ray's own lines
    assert len(ours) == 1 and "Traceback" not in full.stderr + full.stdout, full.stderr[-3000:]
    assert ours[0].startswith(f"raysweep: error: output {out}: writing failed: ")
    assert "No space left on device" in ours[0] and ours[0].endswith("run the same command again")
    assert not [p for p in out.rglob("*.tmp")]
    # committed: what the manifest says (a shard's file may be in place while its journal line met the full disk:
    # it is not committed, and runs again)
    from cluster.store.manifest import read_manifest

    committed = sum(s["state"] == "committed" for s in read_manifest(str(out))["shards"].values())
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    # the failed run's actors go with its driver, as Ray notices it gone: the resume takes their names once they are
    assert wait_for(lambda: not any(a.get("namespace") == "raysweep-full-disk"
                                     for a in ray_local.util.list_named_actors(all_namespaces=True))), \
        "the failed run's actors stayed"
    again = _sweep(spec, out, ray_local)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert f"{committed} already committed" in again.stdout
    rows = pq.read_table(out / "results", columns=["task", "sample_id"]).to_pylist()
    assert len(rows) == len({(r["task"], r["sample_id"]) for r in rows}) == 250 + LEAN_EXTRACT_ROWS


def test_a_journal_line_refused_by_a_full_disk_does_not_fail_the_close(small_disk):
    """The disk filled up as a commit's journal line was flushed: `record` raises, and the sink's close, flushing
    that line again, raised a second OSError, so the run ended in a traceback instead of its one line (seen once
    in the full-disk test above, depending on which write met the full disk)."""
    import pyarrow.fs as pafs

    from cluster.store.manifest import JOURNAL, ManifestWriter, read_manifest

    (small_disk / "manifest.json").write_text('{"shards": {}}')
    with open(small_disk / "filler", "wb", buffering=0) as f:  # the rest of the disk
        try:
            while True:
                f.write(b"x" * 1024)
        except OSError:
            pass
    writer = ManifestWriter(pafs.LocalFileSystem(), str(small_disk))
    with pytest.raises(OSError, match="No space left"):
        writer.record({"shards": {}}, "tiny/t/00000", {"state": "committed", "file": "f" * 8192, "rows": 1})
    writer.close()  # once: no second OSError for the line that was never written
    writer.close()
    assert read_manifest(str(small_disk))["shards"] == {}  # the refused line committed nothing
    assert (small_disk / JOURNAL).exists()
