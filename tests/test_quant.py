"""deltaserve.formats.quant against gguf-py's reference (de)quantisation, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as ref_quants
from gguf.constants import GGML_QUANT_SIZES

from deltaserve.errors import ModelFormatError
from deltaserve.formats import quant

# every type llama.cpp's quantizer writes for these models (issue 30), and the float types
ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
             T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS, T.TQ1_0, T.TQ2_0,
             T.MXFP4, T.NVFP4]
BLOCK_TYPES = [t for t in ALL_TYPES if t not in (T.F32, T.F16, T.BF16)]
# byte offsets of the f16 scale fields inside one block (MXFP4's e8m0 and NVFP4's e4m3 scales have no NaN; IQ1_M's
# f16 is spread over four nibbles: see random_raw)
F16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q2_K: (80, 82),
              T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ1_S: (0,), T.IQ2_XXS: (0,),
              T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,), T.IQ4_NL: (0,), T.IQ4_XS: (0,),
              T.TQ1_0: (52,), T.TQ2_0: (64,), T.IQ1_M: (), T.MXFP4: (), T.NVFP4: ()}
HAS_CUDA = torch.cuda.is_available()


def finite_f16(rng: np.random.Generator, count: int) -> np.ndarray:
    """Random f16 bit patterns (zeros, subnormals, the largest finite values), never inf or NaN."""
    bits = rng.integers(0, 1 << 16, size=count, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= np.uint16(0xBFFF)  # exponent all ones -> clear its top bit
    return bits


def random_raw(qtype: T, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random but valid raw bytes for a tensor of ``shape``: shape[:-1] + (bytes per row,)."""
    rng = np.random.default_rng(seed)
    block, tsize = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    if qtype == T.F32:
        bits = rng.integers(0, 1 << 32, size=n_blocks, dtype=np.uint32)
        bits[(bits & 0x7F800000) == 0x7F800000] &= np.uint32(0xBFFFFFFF)
        raw = bits.view(np.uint8)
    elif qtype == T.F16:
        raw = finite_f16(rng, n_blocks).view(np.uint8)
    elif qtype == T.BF16:
        bits = rng.integers(0, 1 << 16, size=n_blocks, dtype=np.uint16)
        bits[(bits & 0x7F80) == 0x7F80] &= np.uint16(0xBFFF)
        raw = bits.view(np.uint8)
    else:
        blocks = rng.integers(0, 256, size=(n_blocks, tsize), dtype=np.uint8)
        for off in F16_FIELDS[qtype]:
            blocks[:, off:off + 2] = finite_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
        if qtype == T.IQ1_M:  # its f16's exponent's top bit is bit 14 of the last scale word: never all ones
            blocks[:, 55] &= np.uint8(0xBF)
        raw = blocks
    return np.ascontiguousarray(raw).reshape(*shape[:-1], shape[-1] // block * tsize)


def reference(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    with np.errstate(all="ignore"):  # gguf's MXFP4 overflows to inf in f32 for the largest exponents, as ggml does
        return ref_quants.dequantize(raw, qtype).reshape(shape)


def assert_bit_identical(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    assert ours.is_contiguous()
    got = ours.cpu().numpy()
    assert got.shape == ref.shape
    ref = np.ascontiguousarray(ref, dtype=np.float32)
    assert not np.isnan(ref).any()
    same = got.view(np.uint32) == ref.view(np.uint32)
    if not same.all():
        i = tuple(int(v) for v in np.argwhere(~same)[0])
        pytest.fail(f"{(~same).sum()} of {same.size} values differ; first at {i}: {got[tuple(i)]!r} vs {ref[tuple(i)]!r}")


def shapes_for(qtype: T) -> list[tuple[int, ...]]:
    block = GGML_QUANT_SIZES[qtype][0]
    if block == 1:
        return [(1, 1), (64, 96), (3, 160), (2, 3, 40)]
    return [(1, block), (64, block * 2), (3, block * 5), (2, 3, block)]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_every_supported_type_dequantizes_random_valid_blocks_bit_identically_to_gguf(qtype):
    for seed, shape in enumerate(shapes_for(qtype)):
        raw = random_raw(qtype, shape, seed)
        ours = quant.dequantize(raw, qtype, shape)
        assert ours.device.type == "cpu"
        assert_bit_identical(ours, reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_every_byte_of_a_block_changes_what_it_dequantizes_to_as_it_changes_gguf(qtype):
    """Each byte of a block flipped in turn: ours follows gguf's reference every time (no field read wrong or left
    out: a byte gguf reads and we do not would leave our values unchanged where gguf's change)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = random_raw(qtype, (1, block), seed=5)
    for i in range(size):
        flipped = raw.copy()
        flipped[0, i] ^= np.uint8(0x5A)
        with np.errstate(all="ignore"):
            ref = reference(flipped, qtype, (1, block))
        if np.isnan(ref).any() or np.isinf(ref).any():  # a flipped scale made NaN or inf: compared elsewhere
            continue
        assert_bit_identical(quant.dequantize(flipped, qtype, (1, block)), ref)


def test_q4_k_dequantizes_bit_identically_to_gguf():
    shape = (32, 1024)
    raw = random_raw(T.Q4_K, shape, seed=42)
    assert_bit_identical(quant.dequantize(raw, T.Q4_K, shape), reference(raw, T.Q4_K, shape))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0], ids=lambda t: t.name)
def test_data_quantized_by_gguf_dequantizes_bit_identically(qtype):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((16, 256)) * rng.uniform(1e-3, 1e3, size=(16, 1))).astype(np.float32)
    x[3, :64] = 0.0  # all-zero blocks
    raw = ref_quants.quantize(x, qtype)
    ours = quant.dequantize(raw, qtype, x.shape)
    ref = ref_quants.dequantize(raw, qtype) if qtype not in (T.F32, T.F16) else ref_quants.dequantize(raw.view(np.uint8), qtype)
    assert_bit_identical(ours, ref.reshape(x.shape))


@pytest.mark.parametrize("qtype", [T.F32, T.F16], ids=lambda t: t.name)
def test_typed_float_arrays_are_read_as_their_raw_bytes(qtype):
    # GGUFReader hands F32/F16 tensors over as float32/float16 arrays, not bytes
    x = np.random.default_rng(1).standard_normal((5, 12)).astype(np.float32 if qtype == T.F32 else np.float16)
    assert_bit_identical(quant.dequantize(x, qtype, x.shape), x.astype(np.float32))


def test_read_only_and_torch_inputs_give_the_same_result():
    shape = (8, 512)
    raw = random_raw(T.Q6_K, shape, seed=3)
    ref = reference(raw, T.Q6_K, shape)
    ro = raw.copy()
    ro.setflags(write=False)
    assert_bit_identical(quant.dequantize(ro, T.Q6_K, shape), ref)
    assert_bit_identical(quant.dequantize(torch.from_numpy(raw.copy()), T.Q6_K, shape), ref)
    assert_bit_identical(quant.dequantize(raw.tobytes(), T.Q6_K, shape), ref)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_a_byte_buffer_sliced_at_an_odd_offset_still_dequantizes(qtype):
    # e.g. one torch uint8 tensor over a whole file, sliced at each tensor's offset
    for shape in shapes_for(qtype)[:2]:
        raw = random_raw(qtype, shape, seed=19)
        buf = torch.cat((torch.zeros(1, dtype=torch.uint8), torch.from_numpy(raw.reshape(-1))))[1:]
        assert buf.storage_offset() == 1
        assert_bit_identical(quant.dequantize(buf, qtype, shape), reference(raw, qtype, shape))


def test_tensors_read_back_from_a_gguf_file_dequantize_like_gguf(tmp_path):
    import gguf

    rng = np.random.default_rng(5)
    tensors = {
        "f32": (rng.standard_normal((4, 64)).astype(np.float32), T.F32),
        "f16": (rng.standard_normal((4, 64)).astype(np.float32), T.F16),
        "q8": (rng.standard_normal((4, 64)).astype(np.float32), T.Q8_0),
        "q4k": (None, T.Q4_K),
    }
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "test")
    for name, (x, qt) in tensors.items():
        if qt == T.Q4_K:
            raw = random_raw(T.Q4_K, (3, 512), seed=9)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)
        else:
            data = ref_quants.quantize(x, qt)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qt if qt not in (T.F32, T.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    reader = gguf.GGUFReader(str(path))
    assert len(reader.tensors) == len(tensors)
    kinds = {t.name: (t.tensor_type, t.data.dtype) for t in reader.tensors}
    assert kinds["f16"] == (T.F16, np.float16) and kinds["f32"] == (T.F32, np.float32)
    assert kinds["q8"] == (T.Q8_0, np.uint8) and kinds["q4k"] == (T.Q4_K, np.uint8)
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        ours = quant.dequantize(t.data, t.tensor_type, shape)
        ref = ref_quants.dequantize(t.data, t.tensor_type).reshape(shape)
        assert_bit_identical(ours, ref)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_large_tensors_are_done_in_chunks_with_a_ragged_last_chunk(qtype, monkeypatch):
    block = GGML_QUANT_SIZES[qtype][0]
    monkeypatch.setattr(quant, "_CPU_CHUNK_ELEMS", block * 3)
    shape = (7, block * 2)  # 14 blocks in chunks of 3
    raw = random_raw(qtype, shape, seed=17)
    assert_bit_identical(quant.dequantize(raw, qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_rows_equals_the_matching_rows_of_dequantize(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    shape = (50, block * 2 if block > 1 else 24)
    raw = random_raw(qtype, shape, seed=11)
    full = quant.dequantize(raw, qtype, shape)
    rows = torch.tensor([7, 0, 49, 7, 13])
    got = quant.dequantize_rows(raw, qtype, shape, rows)
    assert got.shape == (5, shape[1]) and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), full[rows].view(torch.int32))
    # torch input, a list of ids, a 2-D batch of ids, and no ids at all
    got_t = quant.dequantize_rows(torch.from_numpy(raw), qtype, shape, [49, 1])
    assert torch.equal(got_t.view(torch.int32), full[[49, 1]].view(torch.int32))
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    assert torch.equal(quant.dequantize_rows(raw, qtype, shape, ids), full[ids.long()])
    assert quant.dequantize_rows(raw, qtype, shape, torch.tensor([], dtype=torch.long)).shape == (0, shape[1])


def test_dequantize_rows_refuses_an_out_of_range_row():
    shape = (4, 32)
    raw = random_raw(T.Q8_0, shape)
    with pytest.raises(IndexError, match="4"):
        quant.dequantize_rows(raw, T.Q8_0, shape, torch.tensor([0, 4]))
    with pytest.raises(IndexError):
        quant.dequantize_rows(raw, T.Q8_0, shape, torch.tensor([-1]))


def test_quantize_q8_0_is_bit_identical_to_gguf():
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((24, 320)) * rng.uniform(1e-6, 1e4, size=(24, 1))).astype(np.float32)
    x[0, :32] = 0.0  # all-zero block: d == 0
    # max |x| == 127 makes d == 1 exactly, so these land on exact .5 ties: gguf rounds them away from zero
    x[1, :32] = np.concatenate([[127.0], np.arange(31, dtype=np.float32) - 15.5])
    x[2, :32] = np.concatenate([[-127.0], np.arange(31, dtype=np.float32) * 4.0 - 60.5])
    x[3, 32:64] = rng.choice([-1.0, 1.0], size=32).astype(np.float32) * np.float32(1e-30)  # tiny scale -> f16 zero
    ours = quant.quantize_q8_0(torch.from_numpy(x))
    ref = ref_quants.quantize(x, T.Q8_0)
    assert ours.dtype == np.uint8 and ours.shape == (24, 320 // 32 * 34)
    assert np.array_equal(ours, ref)
    assert_bit_identical(quant.dequantize(ours, T.Q8_0, x.shape), ref_quants.dequantize(ref, T.Q8_0))


def test_a_wrong_byte_count_names_both_numbers():
    shape = (4, 64)
    raw = random_raw(T.Q4_0, shape)  # 4 * 2 * 18 = 144 bytes
    with pytest.raises(ModelFormatError, match=r"144.*143|143.*144"):
        quant.dequantize(raw.reshape(-1)[:-1], T.Q4_0, shape)
    with pytest.raises(ModelFormatError, match=r"144.*216|216.*144"):
        quant.dequantize_rows(raw, T.Q4_0, (6, 64), [0])


def test_a_row_length_that_is_not_a_whole_number_of_blocks_is_refused():
    with pytest.raises(ModelFormatError, match="256"):
        quant.dequantize(np.zeros(144, np.uint8), T.Q4_K, (1, 100))


def test_an_unsupported_type_is_named_along_with_the_supported_ones():
    with pytest.raises(ModelFormatError, match="Q8_K") as e:  # llama.cpp's activations' type: never in a file
        quant.dequantize(np.zeros(292, np.uint8), T.Q8_K, (1, 256))
    for t in ALL_TYPES:
        assert t.name in str(e.value)
    with pytest.raises(ModelFormatError, match="Q8_1"):
        quant.dequantize_rows(np.zeros(36, np.uint8), T.Q8_1, (1, 32), [0])
    with pytest.raises(ModelFormatError, match="9999"):
        quant.dequantize(np.zeros(4, np.uint8), 9999, (1,))


def test_type_size_and_supported_types():
    assert quant.SUPPORTED_TYPES == frozenset(ALL_TYPES)
    for t in ALL_TYPES:
        assert quant.type_size(t) == GGML_QUANT_SIZES[t]
    assert quant.type_size(int(T.Q6_K)) == (256, 210)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_tensors_dequantize_on_the_device_bit_identically(qtype):
    shape = shapes_for(qtype)[2]
    raw = random_raw(qtype, shape, seed=13)
    data = torch.from_numpy(raw).cuda()
    ours = quant.dequantize(data, qtype, shape)
    assert ours.device.type == "cuda"
    assert_bit_identical(ours, reference(raw, qtype, shape))
    if len(shape) == 2:
        got = quant.dequantize_rows(data, qtype, shape, torch.tensor([2, 0], device="cuda"))
        assert got.device.type == "cuda"
        assert torch.equal(got.cpu().view(torch.int32), ours.cpu()[[2, 0]].view(torch.int32))
