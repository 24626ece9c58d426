"""`deltaserve bench vision`: an image's encoding and the first token of a turn that carries it, against llama.cpp.

The 0.8B shape's language model (Q8_0, random weights) with a vision tower of the Qwen3.5 shape transformers gives
by default (27 blocks of 1152, 16 heads, patch 16, merge 2, a 48 x 48 position table; random weights, bf16) into
the 0.8B's width, written as an HF checkpoint's `model.visual.*` and converted by llama.cpp's own converter into its
projector GGUF (`--mmproj`, f16). deltaserve loads the model file with that projector (`--mmproj`); llama.cpp's
llama-server (built with this CPU's widest vectors) loads the same two files. For a 448 x 448 and a 1344 x 1344
image (the processor's pixel bounds: the projector file carries none, so transformers' defaults, up to 1,003,520
pixels: the larger image is resized down to fit) deltaserve's encode alone, and for both
engines the time of a chat turn that carries the image and generates one token (its first token), with the prompt
tokens each made of it, medians.
"""

from __future__ import annotations

import base64
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tools.bench.models import CACHE, model_file
from tools.bench.peers import _free_port, llama_server_binary, serving

SIZES = (448, 1344)
TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
             temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
             hidden_act="gelu_pytorch_tanh", model_type="qwen3_5_vision")
PROCESSOR = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 65536, "longest_edge": 16777216},
             "image_processor_type": "Qwen2VLImageProcessor"}


def _converter() -> Path:
    from tests.test_gguf_conformance import llama_cpp_converter

    return llama_cpp_converter()


def projector(text_config: dict, hidden: int) -> Path:
    """The tower as llama.cpp's projector GGUF (f16), made once: an HF directory holding only `model.visual.*` (random,
    bf16) and the config the converter reads, converted by llama.cpp's converter."""
    import torch
    from safetensors.torch import save_file

    out = CACHE / f"mmproj-qwen35-0.8B-vision-{TOWER['depth']}x{TOWER['hidden_size']}-f16.gguf"
    if out.exists():
        return out
    d = CACHE / "qwen35-0.8B-vision-hf"
    d.mkdir(parents=True, exist_ok=True)
    tower = dict(TOWER, out_hidden_size=hidden)
    g = torch.Generator().manual_seed(7)
    h, f, p, m = tower["hidden_size"], tower["intermediate_size"], tower["patch_size"], tower["spatial_merge_size"]
    mh = h * m * m
    tensors = {"model.visual.patch_embed.proj.weight": torch.randn(h, 3, 2, p, p, generator=g) * (6 * p * p) ** -0.5,
               "model.visual.patch_embed.proj.bias": torch.zeros(h),
               "model.visual.pos_embed.weight": torch.randn(tower["num_position_embeddings"], h, generator=g) * 0.02,
               "model.visual.merger.norm.weight": torch.ones(h), "model.visual.merger.norm.bias": torch.zeros(h),
               "model.visual.merger.linear_fc1.weight": torch.randn(mh, mh, generator=g) * mh ** -0.5,
               "model.visual.merger.linear_fc1.bias": torch.zeros(mh),
               "model.visual.merger.linear_fc2.weight": torch.randn(hidden, mh, generator=g) * mh ** -0.5,
               "model.visual.merger.linear_fc2.bias": torch.zeros(hidden)}
    for i in range(tower["depth"]):
        b = f"model.visual.blocks.{i}."
        for name, shape in (("attn.qkv", (3 * h, h)), ("attn.proj", (h, h)), ("mlp.linear_fc1", (f, h)),
                            ("mlp.linear_fc2", (h, f))):
            tensors[b + name + ".weight"] = torch.randn(*shape, generator=g) * shape[1] ** -0.5
            tensors[b + name + ".bias"] = torch.zeros(shape[0])
        for norm in ("norm1", "norm2"):
            tensors[b + norm + ".weight"], tensors[b + norm + ".bias"] = torch.ones(h), torch.zeros(h)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": dict(text_config, model_type="qwen3_5_text"), "vision_config": tower,
              "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
              "vision_end_token_id": 248054, "tie_word_embeddings": text_config.get("tie_word_embeddings", True)}
    (d / "config.json").write_text(json.dumps(config, indent=1))
    (d / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    script = _converter()
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    part = out.with_suffix(".part")
    subprocess.run([sys.executable, str(script), str(d), "--mmproj", "--outfile", str(part), "--outtype", "f16"],
                   check=True, capture_output=True, env=env, cwd=script.parent)
    part.rename(out)
    return out


def _image(side: int):
    import numpy as np
    from PIL import Image

    g = np.random.default_rng(side)
    return Image.fromarray(g.integers(0, 256, (side, side, 3), dtype=np.uint8), "RGB")


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ours(path: Path, mmproj: Path, threads: int, repeats: int) -> dict:
    import deltaserve

    model = deltaserve.load(path, mmproj=mmproj, threads=threads)
    vision = model.host.vision
    out = {"route": vision.encoder.route()}
    for side in SIZES:
        image = _image(side)
        vision.encode([image])  # the first call's one-time work out of the figures
        encode = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            vision.encode([image])
            encode.append(time.perf_counter() - t0)
        turns = []
        for r in range(repeats):
            session = model.session(quiet=True)
            messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                     {"type": "text", "text": f"Describe picture {r}."}]}]
            t0 = time.perf_counter()
            turn = session.chat(messages, max_tokens=1, enable_thinking=False)
            turns.append(time.perf_counter() - t0)
        out[side] = {"encode_s": statistics.median(encode), "first_token_s": statistics.median(turns),
                     "tokens": vision.tokens(image), "prompt_tokens": turn.prompt_tokens}
    return out


def llama(path: Path, mmproj: Path, threads: int, repeats: int) -> dict:
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(llama_server_binary()), "-m", str(path), "--mmproj", str(mmproj), "--port", str(port), "-t",
           str(threads), "-tb", str(threads), "-c", "8192", "-np", "1", "--jinja", "--no-warmup",
           "--cache-ram", "0"]
    out = {}
    with serving(cmd, url):
        for side in SIZES:
            url_data = _data_url(_image(side))
            times, prompt_ms, prompt_tokens = [], [], None
            for r in range(repeats + 1):
                body = {"messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url_data}},
                    {"type": "text", "text": f"Describe picture {r}."}]}],
                    "max_tokens": 1, "temperature": 0, "cache_prompt": False,
                    "chat_template_kwargs": {"enable_thinking": False}}
                t0 = time.perf_counter()
                resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=900)
                took = time.perf_counter() - t0
                resp.raise_for_status()
                if r:  # the first request's one-time work out of the figures
                    times.append(took)
                    prompt_ms.append((resp.json().get("timings") or {}).get("prompt_ms"))
                    prompt_tokens = (resp.json().get("usage") or {}).get("prompt_tokens")
            out[side] = {"first_token_s": statistics.median(times), "prompt_tokens": prompt_tokens,
                         "prompt_ms": statistics.median([p for p in prompt_ms if p is not None] or [0])}
    return out


def main(a) -> None:
    threads = a.threads or 2
    repeats = 1 if a.quick else max(1, a.repeats)
    path = model_file("0.8B", "q8_0")
    from deltaserve.formats.source import open_model

    m = open_model(path)
    c = m.config
    text = {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "layer_types": list(c.layer_types), "linear_conv_kernel_dim": c.conv_kernel,
            "linear_num_key_heads": c.linear_num_key_heads, "linear_key_head_dim": c.linear_key_head_dim,
            "linear_num_value_heads": c.linear_num_value_heads, "linear_value_head_dim": c.linear_value_head_dim,
            "max_position_embeddings": c.context_length, "tie_word_embeddings": c.tie_word_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta, "partial_rotary_factor":
                                c.rotary_dim / c.head_dim, "mrope_section": list(c.mrope_section),
                                "mrope_interleaved": True}}
    del m
    mmproj = projector(text, c.hidden_size)
    from tools.bench.peers import _cpu_name

    result = {"model": path.name, "projector": mmproj.name, "tower": TOWER, "threads": threads, "repeats": repeats,
              "cpu": _cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "deltaserve": ours(path, mmproj, threads, repeats), "command": a.command_line}
    try:
        result["llama-server"] = llama(path, mmproj, threads, repeats)
    except Exception as e:  # noqa: BLE001 - a llama-server that cannot take the projector: said, ours still written
        result["llama-server error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"[bench] llama-server --mmproj: {result['llama-server error']}", file=sys.stderr)
    out = Path(a.out) / "vision"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    lines = [f"# An image's encoding and first token ({path.name} + {mmproj.name}, random weights, {threads} threads,"
             f" medians of {repeats})", "", f"`{a.command_line}` ({result['cpu']}, {result['date']})", "",
             f"deltaserve's vision tower: {result['deltaserve']['route']}", "",
             "| image | merged patches | deltaserve encode (ms) | deltaserve first token (ms), prompt tokens | "
             "llama-server first token (ms), prompt tokens | its prompt_ms | llama-server / deltaserve |",
             "|---|---|---|---|---|---|---|"]
    for side in SIZES:
        o = result["deltaserve"][side]
        ll = (result.get("llama-server") or {}).get(side)
        lines.append(f"| {side}x{side} | {o['tokens']} | {o['encode_s'] * 1000:.0f} | "
                     f"{o['first_token_s'] * 1000:.0f}, {o['prompt_tokens']} | "
                     + (f"{ll['first_token_s'] * 1000:.0f}, {ll['prompt_tokens']} | {ll['prompt_ms']:.0f} | "
                        f"{ll['first_token_s'] / o['first_token_s']:.2f}x |" if ll else "- | - | - |"))
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
