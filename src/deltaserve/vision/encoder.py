"""Qwen3.5's vision encoder (transformers' `Qwen3_5VisionModel`), in plain torch from the HF tensors.

The math, per call (several images packed in one sequence of patches):

1. patch embedding: the Conv3d over (C, T, P, P) with stride = kernel is one matmul over the flattened patch;
2. learned position embedding: the square table (side = sqrt(num_position_embeddings)) resampled to each
   image's patch grid, bilinear with align_corners=True, laid out in spatial-merge-block order, added;
3. `depth` pre-LayerNorm blocks (eps 1e-6): full bidirectional attention within each image (frame) only, with a
   2-D rotary embedding over the whole head (h and w positions, head_dim/4 frequencies each, theta from
   rope_parameters, default 10000), then an MLP with `hidden_act` (gelu_pytorch_tanh for the released models);
4. the merger: LayerNorm per patch, each spatial_merge_size**2 consecutive patches (one merge block)
   concatenated, fc1, exact GELU, fc2 into the language model's width (out_hidden_size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F

from deltaserve.errors import ModelFormatError

PREFIX = "model.visual."


@dataclass(frozen=True)
class VisionConfig:
    """The vision config of a Qwen3.5 / Qwen3.6 checkpoint (config.json's `vision_config`); the defaults are
    transformers' Qwen3_5VisionConfig defaults (the 27B's encoder but for out_hidden_size)."""

    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | Any) -> "VisionConfig":
        """From config.json (the whole file, or its `vision_config`), or a transformers config object."""
        if not isinstance(config, Mapping):
            config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
        if isinstance(config.get("vision_config"), Mapping):
            config = config["vision_config"]
        names = {f.name for f in fields(cls)} - {"rope_theta"}
        values = {k: config[k] for k in names if config.get(k) is not None}
        for name in ("patch_size", "temporal_patch_size"):
            if isinstance(values.get(name), (list, tuple)):
                sizes = set(values[name])
                if len(sizes) != 1:
                    raise ModelFormatError(f"vision_config.{name} {values[name]}: only square patches are read")
                values[name] = sizes.pop()
        rope = config.get("rope_parameters") or {}
        theta = rope.get("rope_theta", config.get("rope_theta"))
        if theta is not None:
            values["rope_theta"] = float(theta)
        rope_type = rope.get("rope_type", "axial")
        if rope_type != "axial":
            raise ModelFormatError(f"vision_config rope_type {rope_type!r}: only 'axial' is read")
        return cls(**values)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def tokens(self, grid: Sequence[int]) -> int:
        """How many merged tokens (language-model embeddings) an image with this patch grid gives."""
        t, h, w = (int(v) for v in grid)
        return t * h * w // (self.spatial_merge_size ** 2)


def _activation(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name in ("gelu", "gelu_python"):
        return F.gelu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name in ("silu", "swish"):
        return F.silu
    if name == "relu":
        return F.relu
    raise ModelFormatError(f"vision_config.hidden_act {name!r} is not one deltaserve knows")


def _grids(grid_thw) -> list[tuple[int, int, int]]:
    """One (t, h, w) or several (a list of them, or an [n, 3] tensor), as a list of int triples."""
    if isinstance(grid_thw, torch.Tensor):
        grid_thw = grid_thw.tolist()
    grid_thw = list(grid_thw)
    if grid_thw and not hasattr(grid_thw[0], "__len__"):  # a single (t, h, w)
        grid_thw = [grid_thw]
    grids = [tuple(int(v) for v in g) for g in grid_thw]
    if not grids or any(len(g) != 3 for g in grids):
        raise ValueError(f"grid_thw {grid_thw!r}: expected (t, h, w) triples, one per image")
    return grids  # type: ignore[return-value]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionEncoder:
    """The vision tower: `encode(pixel_values, grid_thw)` -> [merged tokens, out_hidden_size].

    Built from a mapping of tensors named as the HF checkpoint names them (`model.visual.patch_embed.proj.weight`,
    ...; pass the whole checkpoint's tensors or only the vision ones, other names are ignored), the vision config,
    and optionally the dtype and device to hold and compute in (default: the tensors' own dtype, CPU).

    `products` "bf16" holds the weights in bf16 and multiplies bf16 inputs (torch's bf16 GEMM, f32 sums), the
    residual stream, the norms and the rotary embedding staying f32, and the attention on attention_vision_avx512.c's
    kernel (bf16 q, k, v, f32 scores and softmax) where this build has it; "f32" (or None: the default) multiplies in
    `dtype`. `vision_products()` says which a CPU runs by default, and `route()` what this encoder runs.

    `blocks` maps weight names (as `tensors` names them) to products on a file's quantized blocks
    (kernels.linear.BlockLinear: f32 in, f32 out, the trunk's kernels), held in place of those weights.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], config: VisionConfig | Mapping[str, Any],
                 *, prefix: str = PREFIX, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, products: str | None = None,
                 blocks: Mapping[str, Any] | None = None):
        self.config = config if isinstance(config, VisionConfig) else VisionConfig.from_hf(config)
        cfg = self.config
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise ModelFormatError(f"vision hidden_size {cfg.hidden_size} over {cfg.num_heads} heads: the head "
                                   f"width must be a whole multiple of 4 for the 2-D rotary embedding")
        side = math.isqrt(cfg.num_position_embeddings)
        if side * side != cfg.num_position_embeddings:
            raise ModelFormatError(f"vision num_position_embeddings {cfg.num_position_embeddings} is not a square")
        self.side = side
        self.device = torch.device(device) if device is not None else None
        ours = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
        self.blocks = {name[len(prefix):]: b for name, b in (blocks or {}).items() if name.startswith(prefix)}
        if not ours:
            raise ModelFormatError(f"no vision tensors: none of the {len(tensors)} tensors is named {prefix}*")
        self.dtype = dtype or next(iter(ours.values())).dtype
        d, m2 = cfg.hidden_size, cfg.spatial_merge_size ** 2
        c, t, p = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
        expected: dict[str, tuple[int, ...]] = {
            "patch_embed.proj.weight": (d, c, t, p, p),
            "patch_embed.proj.bias": (d,),
            "pos_embed.weight": (cfg.num_position_embeddings, d),
            "merger.norm.weight": (d,),
            "merger.norm.bias": (d,),
            "merger.linear_fc1.weight": (d * m2, d * m2),
            "merger.linear_fc1.bias": (d * m2,),
            "merger.linear_fc2.weight": (cfg.out_hidden_size, d * m2),
            "merger.linear_fc2.bias": (cfg.out_hidden_size,),
        }
        for i in range(cfg.depth):
            b = f"blocks.{i}."
            expected.update({
                b + "norm1.weight": (d,), b + "norm1.bias": (d,),
                b + "norm2.weight": (d,), b + "norm2.bias": (d,),
                b + "attn.qkv.weight": (3 * d, d), b + "attn.qkv.bias": (3 * d,),
                b + "attn.proj.weight": (d, d), b + "attn.proj.bias": (d,),
                b + "mlp.linear_fc1.weight": (cfg.intermediate_size, d),
                b + "mlp.linear_fc1.bias": (cfg.intermediate_size,),
                b + "mlp.linear_fc2.weight": (d, cfg.intermediate_size),
                b + "mlp.linear_fc2.bias": (d,),
            })
        for k, b in self.blocks.items():
            if k not in expected or len(expected[k]) != 2 or (b.out_features, b.in_features) != expected[k]:
                raise ModelFormatError(f"vision tensor {prefix}{k} on blocks [{b.out_features}, {b.in_features}] "
                                       f"is not one of the tower's products (the config says "
                                       f"{list(expected.get(k, ()))})")
            if k in ours:
                raise ModelFormatError(f"vision tensor {prefix}{k} given twice (as values and on blocks)")
        missing = [prefix + k for k in expected if k not in ours and k not in self.blocks]
        if missing:
            raise ModelFormatError(f"the vision encoder lacks {len(missing)} tensor(s), first {missing[0]}")
        extra = sorted(prefix + k for k in ours if k not in expected)
        if extra:
            raise ModelFormatError(f"{len(extra)} vision tensor(s) this encoder does not know (a different "
                                   f"architecture or config?), first {extra[0]}")
        for k, shape in expected.items():
            if k in ours and tuple(ours[k].shape) != shape:
                raise ModelFormatError(f"vision tensor {prefix}{k} is {list(ours[k].shape)}, the config says "
                                       f"{list(shape)}")
        if products not in (None, "f32", "bf16"):
            raise ValueError(f"products {products!r}: f32 or bf16")
        self.products = products or "f32"
        if self.products == "bf16":
            self.dtype = torch.float32  # the residual stream, norms and tables; the products' weights are bf16
        w = {k: v.detach().to(device=self.device, dtype=self.dtype).contiguous() for k, v in ours.items()}
        w["patch_embed.proj.weight"] = w["patch_embed.proj.weight"].reshape(d, c * t * p * p)
        if self.products == "bf16":
            for k in w:
                if k.endswith(".weight") and w[k].dim() == 2 and k != "pos_embed.weight":
                    w[k] = w[k].to(torch.bfloat16)
                    w[k[:-len(".weight")] + ".bias"] = w[k[:-len(".weight")] + ".bias"].to(torch.bfloat16)
        self.w = w
        self.act = _activation(cfg.hidden_act)
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim // 2, 2, dtype=torch.float)
                                                  / (cfg.head_dim // 2)))

    @classmethod
    def from_hf_config(cls, tensors: Mapping[str, torch.Tensor], config_json: Mapping[str, Any], **kwargs
                       ) -> "VisionEncoder":
        return cls(tensors, VisionConfig.from_hf(config_json), **kwargs)

    # --- the per-grid tables -------------------------------------------------------------------------------

    def _block_order(self, h: int, w: int) -> torch.Tensor:
        """For each patch in the encoder's order (spatial-merge blocks), its raster index h_i * w + w_i."""
        m = self.config.spatial_merge_size
        idx = torch.arange(h * w).reshape(h // m, m, w // m, m).permute(0, 2, 1, 3)
        return idx.reshape(-1)

    def _interpolation(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bilinear, align_corners=True taps from the table's side onto `size` positions: (lo, hi, weight of hi)."""
        side = self.side
        src = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
        lo = torch.floor(src)
        frac = src - lo
        lo = lo.long()
        hi = (lo + 1).clamp(max=side - 1)
        return lo.clamp(0, side - 1), hi, frac

    def position_embedding(self, h: int, w: int) -> torch.Tensor:
        """The learned table resampled to an h x w patch grid, in the encoder's patch order: [h * w, hidden]."""
        table = self.w["pos_embed.weight"].float().reshape(self.side, self.side, -1)
        h_lo, h_hi, h_f = (x.to(table.device) for x in self._interpolation(h))
        w_lo, w_hi, w_f = (x.to(table.device) for x in self._interpolation(w))
        # taps as transformers weighs them: (1-fh)(1-fw), (1-fh)fw, fh(1-fw), fh fw, summed in that order
        fh, fw = h_f[:, None, None], w_f[None, :, None]
        grid = (table[h_lo][:, w_lo] * ((1 - fh) * (1 - fw)) + table[h_lo][:, w_hi] * ((1 - fh) * fw)
                + table[h_hi][:, w_lo] * (fh * (1 - fw)) + table[h_hi][:, w_hi] * (fh * fw))
        grid = grid.reshape(h * w, -1)
        return grid[self._block_order(h, w).to(grid.device)]

    def rotary(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [h * w, head_dim] (float32) of the 2-D rotary embedding, in the encoder's patch order."""
        order = self._block_order(h, w)
        hpos, wpos = (order // w).float(), (order % w).float()
        freqs = torch.cat((hpos[:, None] * self.inv_freq, wpos[:, None] * self.inv_freq), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    # --- the forward ---------------------------------------------------------------------------------------

    def route(self) -> str:
        """What this encoder runs, in words (the session says it the first time it encodes an image)."""
        on_blocks = ""
        if self.blocks:
            kinds = sorted({kind for b in self.blocks.values() for kind in b.types})
            on_blocks = (f"; its {len(self.blocks)} {'/'.join(kinds)} weights on their own blocks (the trunk's "
                         f"products: the blocks' GEMM or exact chunks)")
        from deltaserve.kernels import native

        kernel = self._native_attention()
        if self.products == "f32":
            attention = (f"{kernel}.c's f32 kernel (AVX2)" if kernel and self.dtype == torch.float32
                         else "torch's SDPA")
            return f"products in {str(self.dtype).replace('torch.', '')}, attention {attention}{on_blocks}"
        attention = (f"{kernel}.c's bf16 kernel (f32 scores and softmax)" if kernel
                     else "torch's SDPA in f32 (no AVX512-BF16 kernel in this build: " + native.status()[1] + ")")
        return (f"products bf16 (torch's bf16 GEMM, f32 sums; residual, norms and rotary f32), attention "
                f"{attention}{on_blocks}")

    def _native_attention(self) -> str | None:
        """The C kernel of this encoder's attention (routes.vision_attention: bf16 where the build has AVX512-BF16 and
        the head width is even, f32 on AVX2), or None (torch's SDPA)."""
        from deltaserve.kernels import routes

        device = self.device.type if self.device is not None else "cpu"
        return routes.vision_attention(self.products, self.config.head_dim, device)

    def _linear(self, x: torch.Tensor, name: str, keep: bool = False) -> torch.Tensor:
        """x times the weight `name`, plus its bias. bf16 products take x in bf16 and give f32, or bf16 where
        `keep` (what goes on into another bf16 product as it is: the MLP's hidden values, the attention's v)."""
        block = self.blocks.get(name + ".weight")
        if block is not None:  # f32 in and out
            y = block(x.float())
            return y + self.w[name + ".bias"].float()
        w = self.w[name + ".weight"]
        if w.dtype != x.dtype:
            y = F.linear(x.to(w.dtype), w, self.w[name + ".bias"])
            return y if keep else y.float()
        return F.linear(x, w, self.w[name + ".bias"])

    def _layer_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"], eps=1e-6)

    def _attention(self, x: torch.Tensor, i: int, cos: torch.Tensor, sin: torch.Tensor,
                   segments: list[int]) -> torch.Tensor:
        cfg = self.config
        n = x.shape[0]
        # the C attention in the products' dtype (bf16, or the f32 route's f32) where the route table has it
        kernel = (torch.bfloat16 if self.products == "bf16" else torch.float32) if self._native_attention() and \
            (self.products == "bf16" or x.dtype == torch.float32) else None
        qkv = self._linear(x, f"blocks.{i}.attn.qkv", keep=kernel is not None)
        q, k, v = qkv.reshape(n, 3, cfg.num_heads, cfg.head_dim).unbind(1)
        c, s = cos[:, None, :], sin[:, None, :]
        qf, kf = q.float(), k.float()
        q, k = qf * c + rotate_half(qf) * s, kf * c + rotate_half(kf) * s  # the rotary embedding in f32
        if kernel is not None:
            from deltaserve.kernels import native

            out = native.attention(q.to(kernel), k.to(kernel), v.to(kernel), cfg.head_dim ** -0.5, segments)
            if out is not None:
                return self._linear(out.reshape(n, cfg.hidden_size), f"blocks.{i}.attn.proj")
        q, k, v = q.to(x.dtype), k.to(x.dtype), v.to(x.dtype)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, n, head_dim]
        outs = [F.scaled_dot_product_attention(qs, ks, vs)  # scale head_dim**-0.5, no mask: within a segment
                for qs, ks, vs in zip(q.split(segments, 1), k.split(segments, 1), v.split(segments, 1))]
        out = torch.cat(outs, dim=1).transpose(0, 1).reshape(n, cfg.hidden_size)
        return self._linear(out, f"blocks.{i}.attn.proj")

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw) -> torch.Tensor:
        """pixel_values [patches, C*T*P*P] (one image's or several concatenated, as `preprocess` gives them),
        grid_thw one (t, h, w) or a list / [n, 3] tensor of them -> [merged tokens, out_hidden_size], the
        images' tokens one after the other. Attention never crosses from one image (or video frame) to another."""
        cfg = self.config
        grids = _grids(grid_thw)
        m = cfg.spatial_merge_size
        total = sum(t * h * w for t, h, w in grids)
        width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        if pixel_values.dim() != 2 or pixel_values.shape[0] != total or pixel_values.shape[1] != width:
            raise ValueError(f"pixel_values {list(pixel_values.shape)} do not match the grids {grids}: "
                             f"expected [{total}, {width}]")
        for t, h, w in grids:
            if h % m or w % m or min(t, h, w) <= 0:
                raise ValueError(f"grid ({t}, {h}, {w}): h and w must be positive multiples of the merge size {m}")
        x = self._linear(pixel_values.to(device=self.device, dtype=self.dtype), "patch_embed.proj")
        pos, cos, sin, segments = [], [], [], []
        for t, h, w in grids:
            pe = self.position_embedding(h, w)
            c, s = self.rotary(h, w)
            pos.append(pe.repeat(t, 1))
            cos.append(c.repeat(t, 1))
            sin.append(s.repeat(t, 1))
            segments += [h * w] * t
        x = x + torch.cat(pos).to(x.dtype)
        cos_t = torch.cat(cos).to(x.device)
        sin_t = torch.cat(sin).to(x.device)
        for i in range(cfg.depth):
            b = f"blocks.{i}."
            x = x + self._attention(self._layer_norm(x, b + "norm1"), i, cos_t, sin_t, segments)
            hidden = self._linear(self._layer_norm(x, b + "norm2"), b + "mlp.linear_fc1", keep=True)
            x = x + self._linear(self.act(hidden), b + "mlp.linear_fc2")
        x = self._layer_norm(x, "merger.norm").reshape(-1, cfg.hidden_size * m * m)
        x = self._linear(F.gelu(self._linear(x, "merger.linear_fc1")), "merger.linear_fc2")
        return x

    def encode_images(self, pixel_values: torch.Tensor, grid_thw) -> list[torch.Tensor]:
        """`encode`, split per image: [tokens_i, out_hidden_size] each."""
        grids = _grids(grid_thw)
        return list(self.encode(pixel_values, grids).split([self.config.tokens(g) for g in grids]))

    def parameters_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.w.values()) + \
            sum(d.numel() for b in self.blocks.values() for _, d in b.segments)


def vision_products() -> str:
    """The vision tower's products by default on this CPU (routes.vision_products): DELTASERVE_VISION "f32" or "bf16"
    as set, else "bf16" where torch's bf16 GEMM runs natively (AVX512-BF16, or AMX tiles) and "f32" elsewhere."""
    from deltaserve.kernels import routes

    return routes.vision_products()


def vision_tensors(tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                   prefix: str = PREFIX) -> dict[str, torch.Tensor]:
    """The `model.visual.*` tensors of a checkpoint's (name, tensor) pairs."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    return {name: t for name, t in items if name.startswith(prefix)}
