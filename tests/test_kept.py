"""The actors a sweep keeps for the next sweep of its process (cluster/schedule/fleet.py KeptActors): only
those whose engine runs a model that did not fail, with no shard in flight; later sweeps find them by the
model's whole spec."""

from types import SimpleNamespace

from cluster.contracts.spec import ModelSpec
from cluster.schedule.fleet import KeptActors


def test_only_running_engines_of_models_that_did_not_fail_are_kept_and_found_by_the_whole_model_spec():
    tiny = ModelSpec("tiny", "builtin:tiny", engine={"max_num_seqs": 32})
    other = ModelSpec("other", "builtin:tiny")
    slot = lambda handle, state, model, inflight=0: SimpleNamespace(  # noqa: E731
        handle=handle, state=state, model=model, inflight=inflight)
    slots = [slot("run-tiny", "running", "tiny"), slot("busy", "running", "tiny", inflight=1),
             slot("starting", "starting", "tiny"), slot("importing", "importing", None),
             slot("run-other", "running", "other")]
    kept = KeptActors()
    closing = kept.keeper({"tiny": tiny, "other": other}, failed=lambda name: name == "other")(slots)
    assert [s.handle for s in closing] == ["busy", "starting", "importing", "run-other"]
    assert kept.running(tiny) == ["run-tiny"]
    # the same name and path with other engine arguments is another engine: a later sweep does not use it
    assert kept.running(ModelSpec("tiny", "builtin:tiny", engine={"max_num_seqs": 8})) == []
    assert kept.running(other) == []
