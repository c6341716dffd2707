"""benchmarks/weights_probe.py: the tensors it hands vLLM are the checkpoint's, read while vLLM imports."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_what_the_reader_read_gives_every_tensor_of_every_file_as_safetensors_loads_it(tmp_path):
    torch = pytest.importorskip("torch")
    import numpy as np
    from safetensors.torch import load_file

    from benchmarks.weight_files import write_weight_files
    from benchmarks.weights_probe import read_all, tensors_of
    from cluster.inputs import builtin_model

    config = {**builtin_model.builtin_config("tiny"), "vocab_size": 512}
    arrays = builtin_model.weight_tensors(config, 1, "uniform", np.dtype("float16"))
    files = write_weight_files(tmp_path, arrays, sum(a.nbytes for a in arrays.values()) // 3)
    read: dict = {}
    read_all(str(tmp_path), read)
    tensors = tensors_of(read)
    expected = {name: t for path in files for name, t in load_file(str(path)).items()}
    assert len(files) >= 3 and set(read) == {str(Path(f)) for f in files} and set(tensors) == set(expected)
    assert all(tensors[name].dtype == torch.float16 and torch.equal(tensors[name], t) for name, t in expected.items())
