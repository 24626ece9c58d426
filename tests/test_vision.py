"""Images: decoding and preprocessing, the vision encoder and the 3-D rotary positions, each against transformers
5.24 (Qwen2VLImageProcessorPil, the processor AutoImageProcessor names for qwen3_5 without torchvision;
Qwen3_5VisionModel; Qwen3_5Model.get_rope_index) on tiny shapes unlike the released ones."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from deltaserve.kernels import native
from deltaserve.vision.encoder import VisionEncoder
from deltaserve.vision.positions import rope_positions, text_positions
from deltaserve.vision.preprocess import ImageError, ProcessorConfig, decode_image, preprocess

transformers = pytest.importorskip("transformers")

# the released checkpoints' kind of settings (patch 16, mean/std 0.5) with small pixel bounds, and transformers'
# class defaults (patch 14, CLIP mean/std)
QWEN35_LIKE = ProcessorConfig(patch_size=16, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), min_pixels=64 * 64,
                              max_pixels=320 * 320)
CLASS_DEFAULTS = ProcessorConfig(max_pixels=300 * 300)


def hf_processor(cfg: ProcessorConfig):
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
                                    merge_size=cfg.merge_size, image_mean=list(cfg.mean), image_std=list(cfg.std),
                                    size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels})


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    if mode == "RGBA":
        return Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    im = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    return im if mode == "RGB" else im.convert(mode)


def encoded(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def png_bomb(width: int, height: int, with_pixels: bool = True) -> bytes:
    """A genuine 1-bit grayscale PNG of width x height black pixels, compressed to a few tens of KB."""
    ihdr = png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
    body = b""
    if with_pixels:
        z = zlib.compressobj(9)
        block = b"\0" * (1 + (width + 7) // 8) * 1000
        body = png_chunk(b"IDAT", b"".join(z.compress(block) for _ in range(height // 1000)) + z.flush())
    return b"\x89PNG\r\n\x1a\n" + ihdr + body + png_chunk(b"IEND", b"")


# --- preprocessing ------------------------------------------------------------------------------------------

def test_transformers_maps_qwen3_5_to_the_qwen2_vl_image_processor():
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    for model_type in ("qwen3_5", "qwen3_5_moe"):
        assert IMAGE_PROCESSOR_MAPPING_NAMES[model_type]["pil"] == "Qwen2VLImageProcessorPil"
    defaults = hf_processor(ProcessorConfig())
    d = ProcessorConfig()
    assert (defaults.patch_size, defaults.temporal_patch_size, defaults.merge_size) == (
        d.patch_size, d.temporal_patch_size, d.merge_size)
    assert (defaults.size["shortest_edge"], defaults.size["longest_edge"]) == (d.min_pixels, d.max_pixels)
    from transformers import Qwen2VLImageProcessorPil

    assert Qwen2VLImageProcessorPil.resample == d.resample
    assert tuple(Qwen2VLImageProcessorPil.image_mean) == d.mean and tuple(Qwen2VLImageProcessorPil.image_std) == d.std


@pytest.mark.parametrize("cfg", [QWEN35_LIKE, CLASS_DEFAULTS], ids=["patch16-mean0.5", "patch14-clip"])
@pytest.mark.parametrize("width,height,mode", [
    (37, 53, "RGB"),      # tiny: upscaled to min_pixels
    (300, 200, "RGB"),
    (123, 457, "RGBA"),   # non-square, transparency composited onto white
    (640, 480, "L"),      # downscaled under max_pixels
    (90, 90, "P"),
    (61, 61, "LA"),
])
def test_preprocessing_matches_the_transformers_image_processor_for_odd_sizes(cfg, width, height, mode):
    image = random_image(width, height, mode, seed=width * height)
    pixel_values, grid = preprocess(image, **cfg.kwargs())
    ref = hf_processor(cfg)(image, return_tensors="pt")
    assert grid == tuple(ref["image_grid_thw"][0].tolist())
    assert pixel_values.dtype == torch.float32 and pixel_values.shape == ref["pixel_values"].shape
    assert (pixel_values - ref["pixel_values"]).abs().max().item() <= 1e-5
    assert cfg.grid(width, height) == grid
    assert cfg.tokens(width, height) == grid[0] * grid[1] * grid[2] // cfg.merge_size ** 2


def test_processor_config_reads_a_preprocessor_config_json():
    cfg = ProcessorConfig.from_hf({"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                                   "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                                   "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessorFast"})
    assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_size, cfg.mean, cfg.resample) == (
        65536, 16777216, 16, (0.5, 0.5, 0.5), int(Image.Resampling.BICUBIC))
    legacy = ProcessorConfig.from_hf({"min_pixels": 3136, "max_pixels": 12845056})
    assert (legacy.min_pixels, legacy.max_pixels) == (3136, 12845056)


def test_an_aspect_ratio_over_200_is_refused_with_the_numbers():
    with pytest.raises(ImageError, match=r"1x300 pixels.*aspect ratio of 300\.0"):
        preprocess(random_image(1, 300), **QWEN35_LIKE.kwargs())


# --- decoding -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_decoding_common_formats_gives_rgb_of_the_same_size(fmt):
    image = random_image(45, 31, seed=3)
    out = decode_image(encoded(image, fmt), max_pixels=10_000)
    assert out.mode == "RGB" and out.size == (45, 31)
    if fmt in ("PNG", "BMP", "TIFF"):
        assert np.array_equal(np.asarray(out), np.asarray(image))


def test_decoding_composites_transparency_onto_white():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    out = np.asarray(decode_image(encoded(rgba, "PNG"), max_pixels=100))
    assert out[0, 0].tolist() == [10, 20, 30] and out[3, 3].tolist() == [255, 255, 255]


def test_a_truncated_file_is_refused():
    data = encoded(random_image(64, 48, seed=5), "PNG")
    with pytest.raises(ImageError, match=r"64x48 PNG image could not be decoded \(truncated or corrupt"):
        decode_image(data[: len(data) // 2], max_pixels=10_000)
    jpeg = encoded(random_image(64, 48, seed=5), "JPEG")
    with pytest.raises(ImageError, match="truncated or corrupt"):
        decode_image(jpeg[: len(jpeg) // 3], max_pixels=10_000)


@pytest.mark.parametrize("data", [b"hello, this is not an image at all", b"\x89PNG\r\n\x1a\n",
                                  b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"],
                         ids=["text", "png-signature-only", "eps"])
def test_bytes_that_are_not_an_image_are_refused(data):
    with pytest.raises(ImageError, match="not an image|header could not be read"):
        decode_image(data, max_pixels=10_000)


def test_empty_and_oversized_payloads_are_refused():
    with pytest.raises(ImageError, match=r"empty \(0 bytes\)"):
        decode_image(b"", max_pixels=100)
    data = encoded(random_image(8, 8), "PNG")
    with pytest.raises(ImageError, match=rf"{len(data)} bytes, over the limit of 100 bytes"):
        decode_image(data, max_pixels=100, max_bytes=100)


def test_an_image_over_the_pixel_limit_is_refused_naming_width_height_and_limit():
    data = encoded(Image.new("RGB", (300, 200)), "PNG")
    with pytest.raises(ImageError, match=r"300x200 pixels \(60000\), over the limit of 59999 pixels"):
        decode_image(data, max_pixels=59_999)
    assert decode_image(data, max_pixels=60_000).size == (300, 200)


@pytest.mark.parametrize("with_pixels", [True, False], ids=["bomb", "header-only"])
def test_a_decompression_bomb_is_refused_from_its_header_without_decoding(with_pixels, monkeypatch):
    from PIL import ImageFile

    data = png_bomb(20000, 20000, with_pixels)
    assert len(data) < 100_000  # 400 million pixels in a few tens of KB
    limit_before = Image.MAX_IMAGE_PIXELS
    loads = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self.size) or real_load(self))
    with pytest.raises(ImageError, match=r"20000x20000 pixels \(400000000\), over the limit of 16777216 pixels"):
        decode_image(data, max_pixels=16_777_216)
    assert loads == []  # the pixels were never decoded: refused from the header
    assert Image.MAX_IMAGE_PIXELS == limit_before  # Pillow's process-wide limit untouched


# --- the vision encoder ---------------------------------------------------------------------------------------

VISION = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=96, patch_size=14,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64,
              rope_parameters={"rope_type": "axial", "rope_theta": 5000.0})


@pytest.fixture(scope="module")
def hf_vision():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    torch.manual_seed(7)
    model = Qwen3_5VisionModel(Qwen3_5VisionConfig(**VISION)).eval()
    with torch.no_grad():  # every weight random, LayerNorms and biases included, so nothing hides behind 1s and 0s
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() < 2 else p.shape[-1] ** -0.5 * 1.5)
                    + (1.0 if name.endswith("norm1.weight") or name.endswith("norm2.weight") else 0.0))
        model.pos_embed.weight.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def encoder(hf_vision):
    tensors = {"model.visual." + k: v for k, v in hf_vision.state_dict().items()}
    tensors["model.language_model.embed_tokens.weight"] = torch.zeros(4, 4)  # other names are ignored
    return VisionEncoder(tensors, {"vision_config": hf_vision.config.to_dict()})


@pytest.fixture(scope="module")
def two_images():
    cfg = ProcessorConfig(patch_size=14, min_pixels=28 * 28, max_pixels=200 * 200)
    a, grid_a = preprocess(random_image(170, 100, seed=1), **cfg.kwargs())
    b, grid_b = preprocess(random_image(50, 120, "RGBA", seed=2), **cfg.kwargs())
    assert grid_a != grid_b and grid_a[1] != grid_a[2]
    return torch.cat([a, b]), [grid_a, grid_b]


def test_the_encoder_reads_its_config_from_config_json(encoder):
    cfg = encoder.config
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.out_hidden_size, cfg.patch_size, cfg.rope_theta,
            cfg.num_position_embeddings, cfg.hidden_act) == (2, 64, 4, 96, 14, 5000.0, 64, "gelu_pytorch_tanh")


def test_vision_features_match_transformers_for_two_images_of_different_sizes(hf_vision, encoder, two_images):
    pixel_values, grids = two_images
    ours = encoder.encode(pixel_values, grids)
    with torch.no_grad():
        ref = hf_vision(pixel_values, grid_thw=torch.tensor(grids)).pooler_output
    assert ours.shape == ref.shape == (sum(encoder.config.tokens(g) for g in grids), 96)
    assert ref.abs().max().item() > 1.0  # a meaningful scale for the tolerance
    assert (ours - ref).abs().max().item() <= 2e-3


def test_attention_does_not_cross_from_one_image_to_another(encoder, two_images):
    pixel_values, grids = two_images
    together = encoder.encode_images(pixel_values, grids)
    apart = [encoder.encode(pv, g) for pv, g in zip(pixel_values.split([g[1] * g[2] for g in grids]), grids)]
    for a, b in zip(together, apart):
        assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-4


def test_a_multi_frame_grid_attends_frame_by_frame_as_transformers(hf_vision, encoder):
    grids = [(2, 4, 6)]
    pixel_values = torch.randn(2 * 4 * 6, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf_vision(pixel_values, grid_thw=torch.tensor(grids)).pooler_output
    assert (encoder.encode(pixel_values, grids) - ref).abs().max().item() <= 2e-3


def _sdpa_within(q, k, v, scale, segments):
    outs, start = [], 0
    for n in segments:
        q_, k_, v_ = (t[start:start + n].float().transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(q_, k_, v_, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.skipif(not native.has("ds_attention_bf16"), reason="attention_vision_avx512.c is built where the CPU has AVX512-BF16")
@pytest.mark.parametrize("n, heads, dim, segments", [(37, 2, 8, [37]), (100, 3, 72, [100]), (65, 4, 18, [20, 45]),
                                                     (300, 1, 16, [100, 33, 167])])
def test_the_bf16_attention_kernel_is_sdpa_over_the_same_inputs_within_each_image(n, heads, dim, segments):
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(n, heads, dim, generator=g).bfloat16() for _ in range(3))
    k = (k * 3).bfloat16()  # peaked rows: the running maximum moves as the keys go by
    got = native.attention(q, k, v, dim ** -0.5, segments)
    want = _sdpa_within(q, k, v, dim ** -0.5, segments)
    assert got.dtype == torch.float32 and got.shape == (n, heads, dim)
    assert (got - want).abs().max().item() <= 5e-3  # the probabilities enter the product with v as bf16
    # and only within each image: the first image's rows alone give its rows
    first = native.attention(q[:segments[0]], k[:segments[0]], v[:segments[0]], dim ** -0.5)
    assert torch.equal(first, got[:segments[0]])


@pytest.mark.skipif(not native.has("ds_attention_f32"), reason="attention_vision_avx2.c's kernel needs AVX2 and FMA")
@pytest.mark.parametrize("n, heads, dim, segments", [(37, 2, 8, [37]), (100, 3, 72, [60, 40]), (17, 1, 5, [17])])
def test_the_f32_attention_kernel_is_sdpa_within_each_image(n, heads, dim, segments):
    g = torch.Generator().manual_seed(n + 1)
    q, k, v = (torch.randn(n, heads, dim, generator=g) for _ in range(3))
    got = native.attention(q, k * 3, v, dim ** -0.5, segments)
    assert (got - _sdpa_within(q, k * 3, v, dim ** -0.5, segments)).abs().max().item() <= 2e-5


def test_the_bf16_tower_stays_within_bf16_of_transformers(hf_vision, two_images):
    tensors = {"model.visual." + k: v for k, v in hf_vision.state_dict().items()}
    tower = VisionEncoder(tensors, {"vision_config": hf_vision.config.to_dict()}, products="bf16")
    assert all(w.dtype == torch.bfloat16 for k, w in tower.w.items() if k.endswith("qkv.weight"))
    pixel_values, grids = two_images
    with torch.no_grad():
        ref = hf_vision(pixel_values, grid_thw=torch.tensor(grids)).pooler_output
    ours = tower.encode(pixel_values, grids)
    assert ours.dtype == torch.float32
    # bf16 keeps 8 bits of each product's inputs: 1.3e-2 here on features of 2.2 (the f32 route: 1.3e-6)
    assert (ours - ref).abs().max().item() <= 3e-2
    assert F.cosine_similarity(ours.flatten(), ref.flatten(), dim=0).item() >= 0.9999
    assert "products bf16" in tower.route()


def test_the_towers_products_follow_the_setting_and_else_the_cpus_bf16(monkeypatch):
    from deltaserve.vision.encoder import vision_products

    monkeypatch.setenv("DELTASERVE_VISION", "f32")
    assert vision_products() == "f32"
    monkeypatch.setenv("DELTASERVE_VISION", "bf16")
    assert vision_products() == "bf16"
    monkeypatch.delenv("DELTASERVE_VISION")
    from deltaserve.kernels import routes

    with routes.override(flags=frozenset({"avx2", "fma", "f16c"})):  # a Zen 3: bf16 GEMMs are emulated
        assert vision_products() == "f32"
    with routes.override(flags=frozenset({"avx2", "avx512f", "avx512_bf16"})):
        assert vision_products() == "bf16"


def test_the_encoder_refuses_missing_or_misshaped_tensors(hf_vision):
    from deltaserve.errors import ModelFormatError

    tensors = {"model.visual." + k: v for k, v in hf_vision.state_dict().items()}
    config = hf_vision.config.to_dict()
    without = {k: v for k, v in tensors.items() if k != "model.visual.blocks.1.attn.proj.bias"}
    with pytest.raises(ModelFormatError, match="lacks 1 tensor.*blocks.1.attn.proj.bias"):
        VisionEncoder(without, config)
    reshaped = dict(tensors, **{"model.visual.merger.linear_fc2.weight": torch.zeros(95, 256)})
    with pytest.raises(ModelFormatError, match=r"merger.linear_fc2.weight is \[95, 256\], the config says \[96, 256\]"):
        VisionEncoder(reshaped, config)
    extra = dict(tensors, **{"model.visual.deepstack_merger_list.0.norm.weight": torch.zeros(256)})
    with pytest.raises(ModelFormatError, match="does not know"):
        VisionEncoder(extra, config)
    with pytest.raises(ValueError, match="do not match the grids"):
        VisionEncoder(tensors, config).encode(torch.zeros(10, 3 * 2 * 14 * 14), [(1, 2, 4)])


# --- 3-D rotary positions ---------------------------------------------------------------------------------------

IMAGE, START, END = 60, 58, 59


@pytest.fixture(scope="module")
def hf_rope_index():
    from transformers import Qwen3_5Config, Qwen3_5Model

    text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_key_head_dim=8,
                linear_num_value_heads=1, linear_value_head_dim=8, layer_types=["full_attention"])
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                  num_position_embeddings=16, spatial_merge_size=2)
    model = Qwen3_5Model(Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                       vision_start_token_id=START, vision_end_token_id=END, video_token_id=61))

    def rope_index(ids, grids):
        ids = torch.tensor([ids])
        positions, delta = model.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE).int(),
                                                image_grid_thw=torch.tensor(grids) if grids else None)
        return positions[:, 0], int(delta)

    return rope_index


def prompt(*parts) -> list[int]:
    """Text parts are lists of ids, an image part is its grid: <|vision_start|>, its placeholders, <|vision_end|>."""
    ids: list[int] = []
    for part in parts:
        if isinstance(part, tuple):
            t, h, w = part
            ids += [START] + [IMAGE] * (t * h * w // 4) + [END]
        else:
            ids += part
    return ids


def test_rope_positions_match_transformers_get_rope_index_for_text_image_text_image_text(hf_rope_index):
    grids = [(1, 4, 6), (1, 10, 2)]
    ids = prompt([1, 2, 3], grids[0], [4, 5, 6, 7], grids[1], [8, 9, 10, 11, 12])
    ref, delta = hf_rope_index(ids, grids)
    ours, next_position = rope_positions(ids, grids, image_token_id=IMAGE, vision_start_token_id=START,
                                         spatial_merge_size=2)
    assert ours.dtype == torch.long and ours.shape == (3, len(ids))
    assert torch.equal(ours, ref)
    assert next_position - len(ids) == delta < 0
    # the encoder's grids, as a tensor, give the same
    assert torch.equal(rope_positions(ids, torch.tensor(grids), image_token_id=IMAGE, vision_start_token_id=START,
                                      spatial_merge_size=2)[0], ref)


def test_text_only_positions_are_three_equal_rows(hf_rope_index):
    ids = [1, 2, 3, 4, 5, 6, 7]
    ours, next_position = rope_positions(ids, None, image_token_id=IMAGE, vision_start_token_id=START,
                                         spatial_merge_size=2)
    assert torch.equal(ours, torch.arange(7).expand(3, 7)) and next_position == 7
    assert torch.equal(text_positions(0, 7), ours)


def test_a_prompt_split_between_calls_continues_the_counter(hf_rope_index):
    grids = [(1, 6, 4), (1, 2, 8)]
    first = prompt([1, 2], grids[0], [3, 4])
    second = prompt([5], grids[1], [6, 7, 8])
    ref, _ = hf_rope_index(first + second, grids)
    head, counter = rope_positions(first, grids[:1], image_token_id=IMAGE, vision_start_token_id=START,
                                   spatial_merge_size=2)
    tail, _ = rope_positions(second, grids[1:], image_token_id=IMAGE, vision_start_token_id=START,
                             spatial_merge_size=2, start_position=counter)
    assert torch.equal(torch.cat([head, tail], dim=1), ref)


def test_placeholders_that_do_not_match_the_images_are_refused():
    kw = dict(image_token_id=IMAGE, vision_start_token_id=START, spatial_merge_size=2)
    ids = prompt([1], (1, 4, 4), [2])
    with pytest.raises(ValueError, match=r"takes 4 placeholder tokens; the prompt has 3"):
        rope_positions([t for i, t in enumerate(ids) if i != 2], [(1, 4, 4)], **kw)
    with pytest.raises(ValueError, match="2 image\\(s\\) given, the prompt has placeholder tokens for 1"):
        rope_positions(ids, [(1, 4, 4), (1, 2, 2)], **kw)
    with pytest.raises(ValueError, match="past its 0 image"):
        rope_positions(ids, [], **kw)
    with pytest.raises(ValueError, match="do not follow the vision start token"):
        rope_positions([1, IMAGE, IMAGE, IMAGE, IMAGE, 2], [(1, 4, 4)], **kw)


# --- the language side: images in the trunk's prefill and the decode after (against transformers) ---------------

@pytest.fixture(scope="module")
def vision_model():
    import deltaserve
    from deltaserve.vision.model import load_vision
    from tests.fixtures import models as fx

    d = fx.hf_dir("vision")
    model = deltaserve.load(d)
    return model, load_vision(d, products="f32"), fx.load_hf_model("vision")  # the exact route against transformers


def _picture(w: int, h: int, seed: int) -> Image.Image:
    g = np.random.default_rng(seed)
    return Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def _image_prompt(vision, images, seed: int = 5) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for im in images:
        ids += torch.randint(20, 400, (7,), generator=g).tolist()
        ids += [vision.vision_start_token_id] + [vision.image_token_id] * vision.tokens(im) + \
            [vision.vision_end_token_id]
    return ids + torch.randint(20, 400, (9,), generator=g).tolist()


def _reference(oracle, vision, ids, images) -> torch.Tensor:
    pixels, grids = [], []
    for im in images:
        values, grid = preprocess(im, **vision.processor.kwargs())
        pixels.append(values)
        grids.append(list(grid))
    with torch.no_grad():
        kinds = torch.tensor([[1 if t == vision.image_token_id else 0 for t in ids]])  # the processor's
        return oracle(input_ids=torch.tensor([ids]), pixel_values=torch.cat(pixels), mm_token_type_ids=kinds,
                      image_grid_thw=torch.tensor(grids)).logits[0].float()


@pytest.mark.parametrize("rows", [4096, 11], ids=["one-chunk", "chunks-of-11-rows"])
def test_a_prompt_with_two_images_gives_transformers_logits_and_the_decode_after_it_too(vision_model, rows):
    model, vision, oracle = vision_model
    images = [_picture(70, 42, 1), _picture(30, 58, 2)]  # grids unlike each other and not square
    ids = _image_prompt(vision, images)
    want = _reference(oracle, vision, ids, images)
    forward = model._reference_forward()
    state = forward.new_state(len(ids) + 4, prefill_rows=rows)
    got = forward.prefill(state, ids, all_logits=True, images=vision.span(ids, images, 0))
    assert (got - want).abs().max().item() <= 2e-3 and torch.equal(got.argmax(-1), want.argmax(-1))
    assert state.rope_delta < 0  # the images advanced the positions by their sides, not their token counts
    # the text after the prompt: one decode step at index len(ids), rotary position len(ids) + rope_delta
    after = [int(want[-1].argmax()), 33]
    for k, token in enumerate(after):
        step = forward.decode(state, token)
        ref = _reference(oracle, vision, ids + after[:k + 1], images)[-1]
        assert (step - ref).abs().max().item() <= 2e-3 and int(step.argmax()) == int(ref.argmax())


def test_the_moe_checkpoints_tower_and_trunk_give_transformers_features_and_logits_for_an_image_prompt():
    """Qwen3_5MoeForConditionalGeneration (the 35B-A3B's layout: the experts under model.language_model, the tower
    under model.visual; here a tower of its own shape, patch 16): its features, and the logits of a prompt with two
    images through the MoE trunk and the decode step after it, as transformers computes them."""
    import deltaserve
    from deltaserve.vision.model import load_vision
    from tests.fixtures import models as fx

    d = fx.hf_dir("moe_vision")
    model, vision, oracle = deltaserve.load(d), load_vision(d, products="f32"), fx.load_hf_model("moe_vision")
    assert type(oracle).__name__ == "Qwen3_5MoeForConditionalGeneration" and model.config.num_experts == 8
    images = [_picture(80, 48, 11), _picture(40, 72, 12)]
    pixels, grids = zip(*(preprocess(im, **vision.processor.kwargs()) for im in images))
    with torch.no_grad():
        ref = oracle.model.visual(torch.cat(pixels), grid_thw=torch.tensor([list(g) for g in grids])).pooler_output
    ours = vision.encoder.encode(torch.cat(pixels), [list(g) for g in grids])
    assert ours.shape == ref.shape and (ours - ref).abs().max().item() <= 2e-3
    ids = _image_prompt(vision, images, seed=9)
    want = _reference(oracle, vision, ids, images)
    forward = model._reference_forward()
    state = forward.new_state(len(ids) + 2)
    got = forward.prefill(state, ids, all_logits=True, images=vision.span(ids, images, 0))
    assert (got - want).abs().max().item() <= 2e-3 and torch.equal(got.argmax(-1), want.argmax(-1))
    token = int(want[-1].argmax())
    step = forward.decode(state, token)
    after = _reference(oracle, vision, ids + [token], images)[-1]
    assert (step - after).abs().max().item() <= 2e-3 and int(step.argmax()) == int(after.argmax())


def test_a_text_prompt_keeps_its_logits_with_the_vision_tower_loaded(vision_model):
    model, vision, oracle = vision_model
    ids = torch.randint(20, 400, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = oracle(input_ids=torch.tensor([ids])).logits[0].float()
    got = model.logits(ids)
    assert (got - want).abs().max().item() <= 2e-3 and torch.equal(got.argmax(-1), want.argmax(-1))


# --- images through the resident session ------------------------------------------------------------------------

from deltaserve.vision.inputs import ImageInput  # noqa: E402


def _chat_with(image, question: str = "Describe it."):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]


def test_a_session_answers_about_an_image_as_a_one_call_turn_does_and_a_follow_up_prefills_only_its_text(vision_model,
                                                                                                      monkeypatch):
    model, vision, oracle = vision_model
    image = _picture(70, 42, 1)
    session = model.session(quiet=True)
    encoded = []
    real_encode = type(session.host.vision.encoder).encode
    monkeypatch.setattr(type(session.host.vision.encoder), "encode",
                        lambda self, px, grid: encoded.append(grid) or real_encode(self, px, grid))
    messages = _chat_with(image)
    first = session.chat(messages, max_tokens=6, enable_thinking=False)
    assert len(encoded) == 1
    ids, _ = session.render(messages, enable_thinking=False)
    assert first.prompt_tokens == len(ids) and sum(t >= model.config.vocab_size for t in ids) == vision.tokens(image)
    fresh = model.generate(ids, max_tokens=6, images=[ImageInput.of(image)])
    assert fresh.tokens == first.tokens  # the session's turn is the one-call turn (which encodes it on its own)
    # teacher-forced against transformers: the prompt's last position
    real = [vision.image_token_id if t >= model.config.vocab_size else t for t in ids]
    want = _reference(oracle, vision, real, [image])[-1]
    assert int(want.argmax()) == first.tokens[0]
    vision_route = session.host.vision.encoder.route()
    follow = messages + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And again?"}]
    second = session.chat(follow, max_tokens=4, enable_thinking=False)
    assert len(encoded) == 2  # the session's follow-up did not encode the image again
    # reused from the checkpoint before the first answer's header (the history renders the answer anew): the image
    # is in what was reused, only the text after it was prefilled
    assert second.reused > ids.index(vision.vision_end_token_id) and second.start == "checkpoint"
    # raw ids that extend the conversation the state holds (its image's placeholders among them), no image given:
    # only the new text is fed, and a repetition penalty reads the text ids alone
    held = list(session.held)
    third = session.generate(held + [33, 44], max_tokens=2, repetition_penalty=1.3)
    assert third.reused == len(held) and len(encoded) == 2
    # the tower's route is said once, the first time an image is encoded
    assert [n for n in session.notices if "vision tower:" in n] == [f"[deltaserve] vision tower: {vision_route}"]


def test_two_conversations_with_equal_text_and_different_images_never_share_a_state(vision_model):
    model, vision, oracle = vision_model
    a, b = _picture(70, 42, 1), _picture(70, 42, 2)  # one size, other pixels: the same token count
    session = model.session(quiet=True)
    session.chat(_chat_with(a), max_tokens=3, enable_thinking=False)
    ids_a, _ = session.render(_chat_with(a), enable_thinking=False)
    ids_b, _ = session.render(_chat_with(b), enable_thinking=False)
    assert len(ids_a) == len(ids_b) and ids_a != ids_b
    assert session.reusable(ids_b) == 0 < session.reusable(ids_a)
    turn = session.chat(_chat_with(b), max_tokens=3, enable_thinking=False)
    assert turn.reused < ids_b.index(next(t for t in ids_b if t >= model.config.vocab_size))


def test_a_bad_image_is_refused_with_what_is_wrong(vision_model):
    from deltaserve.vision.inputs import ImageInputError

    model, vision, oracle = vision_model
    session = model.session(quiet=True)
    with pytest.raises(ImageInputError, match=r"messages\[0\]\.content\[0\]: .*not an image"):
        session.chat(_chat_with(b"GIF89a-not-really"), max_tokens=2)
    with pytest.raises(ImageInputError, match="not fetched"):
        session.chat(_chat_with("https://example.com/cat.png"), max_tokens=2)
    text_only = deltaserve_text_model()
    with pytest.raises(Exception, match="no vision encoder"):
        text_only.session(quiet=True).chat(_chat_with(_picture(30, 30, 3)), max_tokens=2)


def deltaserve_text_model():
    import deltaserve
    from tests.fixtures import models as fx

    return deltaserve.load(fx.gguf_path("hybrid", "f32"))


# --- images through the server: chat completions and the Responses API, the bad-image table ----------------------

def _data_url(image: Image.Image, fmt: str = "PNG") -> str:
    import base64

    return f"data:image/{fmt.lower()};base64," + base64.b64encode(encoded(image, fmt)).decode()


@pytest.fixture(scope="module")
def vision_server():
    from tests.fixtures import models as fx
    from tests.server_proc import ServerProcess

    s = ServerProcess(fx.hf_dir("vision"), "--slots", "1", "--max-image-pixels", "250000", "--allow-image-urls",
                      "--allow-private-image-urls")  # (the test's image site is on loopback)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def image_site(tmp_path_factory):
    """A local web server for image links: picture.png, and a 404 for anything else."""
    import functools
    import http.server
    import threading

    root = tmp_path_factory.mktemp("site")
    _picture(70, 42, 1).save(root / "picture.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_an_image_url_part_is_answered_and_a_follow_up_prefills_only_its_new_text(vision_server):
    import openai

    client = openai.OpenAI(base_url=vision_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    parts = [{"type": "image_url", "image_url": {"url": _data_url(_picture(70, 42, 1))}},
             {"type": "text", "text": "Describe it."}]
    messages = [{"role": "user", "content": parts}]
    first = client.chat.completions.create(model="hf", messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # another conversation with another image takes the server's one slot: the first one's state goes to the store
    other = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(_picture(42, 70, 3))}},
                                          {"type": "text", "text": "Describe it."}]}]
    client.chat.completions.create(model="hf", messages=other, max_tokens=4, temperature=0,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And again?"}]
    second = client.chat.completions.create(model="hf", messages=messages, max_tokens=4, temperature=0,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    image_end = 4 + 1 + 4 + 1  # system-less prompt: <|im_start|>user\n, the image's 4 merged patches, its markers
    assert second.usage.prompt_tokens_details.cached_tokens >= image_end
    # restored from the store, the follow-up did not encode its image again: two encodings, one per conversation
    assert vision_server.stderr.count("prefill with images") == 2
    # the Responses API: an input_image, then a follow-up by previous_response_id (only the new text prefilled)
    r = client.responses.create(model="hf", input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": _data_url(_picture(30, 58, 2))},
        {"type": "input_text", "text": "What is it?"}]}], max_output_tokens=4, temperature=0)
    r2 = client.responses.create(model="hf", input="More?", previous_response_id=r.id, max_output_tokens=4,
                                 temperature=0)
    # everything before: the image's prompt and its answer (all but the last token where max_output_tokens cut it)
    held = r.usage.input_tokens + r.usage.output_tokens - (r.status == "incomplete")
    assert r2.usage.input_tokens_details.cached_tokens == held


def test_an_anthropic_image_message_is_answered_through_the_sdk(vision_server):
    """Anthropic's Messages API, an image block with a base64 source (tests/test_anthropic.py has the rest)."""
    import base64

    import anthropic

    before = vision_server.stderr.count("prefill with images")
    client = anthropic.Anthropic(base_url=vision_server.url, api_key="unused", max_retries=0, timeout=120)
    data = base64.b64encode(encoded(_picture(56, 28, 6), "PNG")).decode()
    m = client.messages.create(model="hf", max_tokens=4, extra_body={"temperature": 0}, thinking={"type": "disabled"},
                               messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": data}},
                                     {"type": "text", "text": "Describe it."}]}])
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens >= 1
    assert vision_server.stderr.count("prefill with images") == before + 1  # the image was encoded and fed
    counted = client.messages.count_tokens(model="hf", thinking={"type": "disabled"}, messages=[{"role": "user",
                                                                                                "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "Describe it."}]}])
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def _truncated_png() -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(encoded(_picture(40, 40, 4), "PNG")[:60]).decode()


BAD_IMAGES = [
    ("truncated", _truncated_png, "could not be"),
    ("not an image", lambda: "data:image/png;base64," + __import__("base64").b64encode(b"hello, not pixels").decode(),
     "not an image"),
    ("too many pixels", lambda: _data_url(_picture(600, 500, 5)), "600x500 pixels (300000), over the limit of 250000"),
    ("a decompression bomb", lambda: "data:image/png;base64," + __import__("base64").b64encode(
        png_bomb(20000, 20000, False)).decode(), "20000x20000 pixels"),
    ("a link to nothing", lambda: "http://127.0.0.1:9/missing.png", "could not be fetched"),
    ("an ftp link", lambda: "ftp://127.0.0.1/x.png", "must be a data URL"),
    ("not base64", lambda: "data:image/png;base64,@@@", "not valid base64"),
]


@pytest.mark.parametrize("what,url,says", BAD_IMAGES, ids=[b[0] for b in BAD_IMAGES])
def test_a_bad_image_gets_a_400_that_says_what_is_wrong_and_the_server_goes_on(vision_server, what, url, says):
    import httpx

    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url()}},
                                                      {"type": "text", "text": "Describe it."}]}], "max_tokens": 2}
    r = httpx.post(vision_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[0]" and says in err["message"]
    ok = httpx.post(vision_server.url + "/v1/chat/completions", timeout=60,
                    json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert ok.status_code == 200


def test_the_bad_image_table_leaves_the_servers_memory_where_it_was(vision_server):
    """Every bad image is refused before its pixels are held (the bomb from its header): after a warm-up round,
    five more rounds of the whole table leave the server's resident memory within 24 MiB of where it was (one
    decoded 20000x20000 bomb would be 1.2 GB)."""
    import httpx

    def one_round():
        for _, url, _ in BAD_IMAGES:
            body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url()}},
                                                              {"type": "text", "text": "Describe it."}]}],
                    "max_tokens": 2}
            assert httpx.post(vision_server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 400

    one_round()
    before = vision_server.rss()
    for _ in range(5):
        one_round()
    grown = vision_server.rss() - before
    assert grown < 24 << 20, f"the server grew by {grown / 2**20:.1f} MiB over five rounds of bad images"


def test_the_one_call_native_decode_after_an_image_ropes_at_the_shifted_position(vision_model, monkeypatch):
    """On the file's blocks (Q8_0 everywhere) the decode after an image runs in the one native call, at its rotary
    position (index + rope_delta): it follows the torch step there, and not where the shift is left out."""
    from deltaserve.engine.forward import Forward
    from tests.test_native_avx2 import blocks_everywhere, need

    need("ds_decode_tokens")
    model, vision, oracle = vision_model
    f = Forward(model.config, blocks_everywhere(model, False))
    program = f.token_program()[0]
    assert program is not None
    calls = []
    real_rows = type(program).rows
    monkeypatch.setattr(type(program), "rows", lambda self, *a, **kw: calls.append(kw.get("rope")) or
                        real_rows(self, *a, **kw))
    images = [_picture(70, 42, 1), _picture(30, 58, 2)]
    ids = _image_prompt(vision, images)
    states = [f.new_state(len(ids) + 2) for _ in range(3)]
    for st in states:
        f.prefill(st, ids, images=vision.span(ids, images, 0))
    assert states[0].rope_delta < 0
    native = f.decode(states[0], 33)                                             # one native call
    assert calls == [[len(ids) + states[1].rope_delta]]
    torch_step = f._run(states[1], torch.tensor([33]), chunked=False, all_logits=False)[0]  # the torch step
    states[2].rope_delta = 0                                                    # the shift left out
    unshifted = f.decode(states[2], 33)
    near = (native - torch_step).abs().max().item()
    assert near < 0.02 and int(native.argmax()) == int(torch_step.argmax())
    assert (unshifted - torch_step).abs().max().item() > 5 * near


# --- the command line: run --image, and the REPL's /image --------------------------------------------------------

def test_run_answers_about_an_image_file_and_the_repl_attaches_one_to_the_next_message(vision_model, tmp_path):
    import io
    import subprocess
    import sys

    from deltaserve.frontends.repl import ChatREPL
    from tests.fixtures import models as fx

    path = tmp_path / "picture.png"
    _picture(70, 42, 1).save(path)
    run = subprocess.run([sys.executable, "-m", "deltaserve", "run", str(fx.hf_dir("vision")), "--image", str(path),
                          "-p", "Describe it.", "-n", "3", "--think", "off", "--device", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "prefill with images" in run.stderr and "[stats] prompt" in run.stderr
    inspect = subprocess.run([sys.executable, "-m", "deltaserve", "inspect", str(fx.hf_dir("vision"))],
                             capture_output=True, text=True, timeout=300)
    assert "vision encoder: yes (model.visual.*: 2 blocks of 32, patch 14, merge 2" in inspect.stdout
    model, vision, oracle = vision_model
    out = io.StringIO()
    repl = ChatREPL(model, model.session(quiet=True), {}, 3, None, False, out=out)
    lines = iter([f"/image {path}", "/image missing.png", "Describe it.", "And again?"])

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    repl.loop(read=read)
    said = out.getvalue()
    assert f"[image {path} (70x42) goes with your next message]" in said and "[image not attached:" in said
    assert repl.session.image_prefills == 1 and repl.session.turns == 2  # the follow-up did not encode it again
    assert repl.messages[0]["content"][0] == {"type": "image", "image": str(path)}


def test_with_allow_image_urls_a_link_is_fetched_and_answered_as_its_data_url_is(vision_server, image_site):
    import httpx

    def ask(url):
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": "Describe it."}]}],
                "max_tokens": 3, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
        return httpx.post(vision_server.url + "/v1/chat/completions", json=body, timeout=60)

    linked, inline = ask(image_site + "/picture.png"), ask(_data_url(_picture(70, 42, 1)))
    assert linked.status_code == inline.status_code == 200
    assert linked.json()["choices"][0]["message"] == inline.json()["choices"][0]["message"]
    missing = ask(image_site + "/nothing.png")
    assert missing.status_code == 400 and "could not be fetched" in missing.json()["error"]["message"]


def test_after_a_restart_a_follow_up_to_an_image_resumes_from_the_state_file_at_its_shifted_position(tmp_path):
    """--state-dir: the state after the image's turn (its rope_delta in the file) comes back in a new process, and
    the follow-up prefills only its text and answers as the first process would have."""
    import openai

    from tests.fixtures import models as fx
    from tests.server_proc import ServerProcess

    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(_picture(30, 58, 2))}},
                                          {"type": "text", "text": "Describe it."}]}]
    kw = dict(model="hf", max_tokens=4, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    answers = []
    for restart in (False, True):
        d = tmp_path / ("restart" if restart else "same")
        with ServerProcess(fx.hf_dir("vision"), "--slots", "1", "--state-dir", str(d)) as s:
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            one = c.chat.completions.create(messages=first, **kw)
            follow = first + [{"role": "assistant", "content": one.choices[0].message.content},
                              {"role": "user", "content": "And again?"}]
            if restart:
                s.stop()
                with ServerProcess(fx.hf_dir("vision"), "--slots", "1", "--state-dir", str(d)) as s2:
                    c2 = openai.OpenAI(base_url=s2.url + "/v1", api_key="unused", max_retries=0, timeout=120)
                    two = c2.chat.completions.create(messages=follow, **kw)
                    assert "prefill with images" not in s2.stderr  # the image came back with the state
                from deltaserve.session.store import read_header

                deltas = {read_header(f).get("rope_delta") for f in d.glob("*.state")}
                assert deltas and all(int(v) < 0 for v in deltas)  # written with the shift it holds
            else:
                two = c.chat.completions.create(messages=follow, **kw)
        assert two.usage.prompt_tokens_details.cached_tokens >= 10
        answers.append(two.choices[0].message.content)
    assert answers[0] == answers[1]
