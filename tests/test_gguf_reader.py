"""Our GGUF header parser reads what the `gguf` package's reader reads, much faster."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from deltaserve.errors import ModelFormatError
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


def _strings_gguf(path, values) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_array("test.strings", values)
    w.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_string_arrays_with_nul_bytes_broken_utf8_or_empty_strings_read_as_each_string_alone(tmp_path):
    path = tmp_path / "strings.gguf"
    values = ["a", "b\x00c", "", "ü", "加拿大", "x" * 300]
    _strings_gguf(path, values)
    assert read_gguf(path).metadata["test.strings"] == values
    raw = path.read_bytes()  # a lone continuation byte inside the fourth string: U+FFFD there, nothing else moves
    at = raw.index("ü".encode())
    path.write_bytes(raw[:at] + b"\x80\xbc" + raw[at + 2:])
    ref = GGUFReader(path).fields["test.strings"]
    want = [bytes(ref.parts[i]).decode("utf-8", errors="replace") for i in ref.data]
    assert read_gguf(path).metadata["test.strings"] == want == ["a", "b\x00c", "", "\ufffd\ufffd", "加拿大", "x" * 300]


def test_a_file_cut_inside_a_string_array_names_the_byte_it_ends_at(tmp_path):
    path = tmp_path / "strings.gguf"
    _strings_gguf(path, ["one", "two", "three" * 50])
    raw = path.read_bytes()
    cut = raw.index(b"three") + 7
    path.write_bytes(raw[:cut])
    with pytest.raises(ModelFormatError, match=f"truncated GGUF: strings.gguf ends at byte {cut} while reading test.strings"):
        read_gguf(path)
