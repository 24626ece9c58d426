"""Our GGUF header parser reads what the `gguf` package's reader reads, much faster."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from deltaserve.formats.gguf import read_gguf
from tests.fixtures import models as fx


@pytest.mark.parametrize("name,kind", [("hybrid", "f32"), ("deep", "q8_0"), ("multimodal", "f32")])
def test_metadata_and_tensors_equal_the_gguf_packages_reader(name, kind):
    path = fx.gguf_path(name, kind)
    ours = read_gguf(path)
    ref = GGUFReader(path)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.metadata) == set(want)
    for k, v in want.items():
        got = ours.metadata[k]
        if isinstance(v, float):
            assert got == pytest.approx(v)
        else:
            assert got == v, k
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.qtype == t.tensor_type
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert np.array_equal(mine.data, np.asarray(t.data).view(np.uint8).reshape(-1))
