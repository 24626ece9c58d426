"""Train the demo model's MTP block next to its frozen trunk, on the demo corpus, and write it into the GGUF in
llama.cpp's layout (`blk.{N}.nextn.*` and the block's attention and FFN tensors after the N trunk blocks,
`{arch}.nextn_predict_layers` = 1), so that `deltaserve run` drafts with it and llama.cpp's `--spec-type draft-mtp`
can run the same file.

    .venv/bin/python scripts/demo/train_mtp.py --out /tmp/demo-mtp --minutes 12 [--install]

The block is the one every Qwen3.5 checkpoint carries: the next token's embedding and the trunk's hidden row at the
position before it (after the final norm), each RMS-normed, concatenated [embedding | hidden] and projected to the
model's width (eh_proj), one gated full-attention decoder block (initialised from the trunk's last attention
layer), the head's norm, and the trunk's (tied) head. Row p reads (x_p, h_{p-1}) and is trained to predict
x_{p+1}; row 0 reads a zero hidden row, as llama.cpp's and deltaserve's caches do at position 0. The trunk's rows
come from deltaserve's own forward on the shipped file (exact f32), so the block learns the rows it will see.
The loss weighs the assistant's tokens (what is generated, so what is drafted) 1 and the rest 0.1.

After training: the block written into a copy of the shipped GGUF, read back by deltaserve, its logits compared
with the training module's (the export is checked), and greedy acceptance measured on held-out conversations of the
evaluation split. `--install` replaces src/deltaserve/data/demo-qwen35.gguf (the trunk's tensors are copied byte for
byte: every answer of the shipped model stays as it was) and writes scripts/demo/mtp_training_log.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (str(ROOT), str(ROOT / "src"), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gguf import GGUFReader, GGUFValueType  # noqa: E402

import corpus as C  # noqa: E402
import train as T  # noqa: E402
from deltaserve.engine.host import load_host  # noqa: E402
from deltaserve.engine import layers as L  # noqa: E402
from deltaserve.formats.config import NEXTN_KEY, RECURRENT_LAYERS_KEY  # noqa: E402
from deltaserve.runtime.backend import CPUBackend  # noqa: E402

INSTALL = ROOT / "src" / "deltaserve" / "data" / "demo-qwen35.gguf"
LOG = HERE / "mtp_training_log.json"


class MtpBlock(torch.nn.Module):
    """The MTP block in training form: layers.py's math (gated attention with q/k norms and partial rotary, SwiGLU
    MLP, multiplicative RMS norms), batched over padded sequences with a causal mask."""

    def __init__(self, host):
        super().__init__()
        c, w = host.config, host.weights
        self.c = c
        h = c.hidden_size
        src = w.layers[c.attention_layers[-1]]  # the trunk's last attention layer: a start that already attends

        def dense(lin) -> torch.Tensor:
            return lin(torch.eye(lin.in_features)).t().contiguous().float()  # [out, in] of any Linear

        def param(t: torch.Tensor) -> torch.nn.Parameter:
            return torch.nn.Parameter(t.detach().clone().float())

        g = torch.Generator().manual_seed(5)
        eh = torch.randn(h, 2 * h, generator=g) * 0.02
        eh[:, h:] += torch.eye(h)  # starts as "the hidden row, plus a little of the token"
        self.eh_proj = param(eh)
        self.enorm, self.hnorm = param(torch.ones(h)), param(torch.ones(h))
        self.attn_norm, self.post_norm = param(src.attn_norm), param(src.post_norm)
        mx = src.mixer
        self.qkv = param(dense(mx.qkv))  # [nh*2hd + 2 nkv hd, h]
        self.o = param(dense(mx.o))
        self.q_norm, self.k_norm = param(mx.q_norm), param(mx.k_norm)
        self.gate_up = param(dense(src.gate_up))
        self.down = param(dense(src.down))
        self.head_norm = param(w.final_norm)
        self.embed = w.embed.weight.detach().float()  # frozen, shared with the trunk (tied head)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """ids [B, T], hidden [B, T, H] (row p: the trunk's row at p-1) -> logits [B, T, vocab]."""
        c, eps = self.c, self.c.rms_norm_eps
        b, t = ids.shape
        nh, nkv, hd = c.num_attention_heads, c.num_kv_heads, c.head_dim
        e = self.embed[ids]
        x = torch.cat([L.rms_norm(e, self.enorm, eps), L.rms_norm(hidden, self.hnorm, eps)], -1) @ self.eh_proj.t()
        a = L.rms_norm(x, self.attn_norm, eps) @ self.qkv.t()
        qg, k, v = a.split([nh * 2 * hd, nkv * hd, nkv * hd], -1)
        qg = qg.reshape(b, t, nh, 2 * hd)
        q = L.rms_norm(qg[..., :hd], self.q_norm, eps)
        gate = qg[..., hd:].reshape(b, t, nh * hd)
        k = L.rms_norm(k.reshape(b, t, nkv, hd), self.k_norm, eps)
        v = v.reshape(b, t, nkv, hd)
        cos, sin = L.rope_tables(torch.arange(t), c.rotary_dim, c.rope_theta)
        q = L.apply_rope(q.reshape(b * t, nh, hd), cos.repeat(b, 1), sin.repeat(b, 1)).reshape(b, t, nh, hd)
        k = L.apply_rope(k.reshape(b * t, nkv, hd), cos.repeat(b, 1), sin.repeat(b, 1)).reshape(b, t, nkv, hd)
        rep = nh // nkv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        o = o.transpose(1, 2).reshape(b, t, nh * hd) * torch.sigmoid(gate)
        x = x + o @ self.o.t()
        gu = L.rms_norm(x, self.post_norm, eps) @ self.gate_up.t()
        gate_, up = gu.chunk(2, -1)
        x = x + (F.silu(gate_) * up) @ self.down.t()
        return L.rms_norm(x, self.head_norm, eps) @ self.embed.t()


def samples(host, forward, rng: random.Random, n: int, split: str = "train") -> list[tuple]:
    """`n` conversations of the demo corpus as (ids, hidden rows shifted by one, target weights)."""
    enc = T.Encoder(host.tokenizer)
    out = []
    for _ in range(n):
        if split == "train" and rng.random() < 0.2:
            d = C.ToolMaker(rng, "train").dialog()
            ids, w, _ = enc.tool_sample(d)
        else:
            turns = T.train_conversation(rng, 1.0) if split == "train" else C.recall_conversation(rng, "eval")[0]
            ids, w, _ = enc.sample(turns, None if rng.random() < 0.1 else False)
        state = forward.new_state(len(ids))
        h = forward.hidden_rows(state, ids)
        shifted = torch.cat([torch.zeros(1, h.shape[1]), h[:-1]])
        tw = torch.tensor([max(x, 0.1) for x in w[1:]] + [0.0])  # row p predicts ids[p + 1]
        out.append((torch.tensor(ids), shifted, tw))
    return out


def batches(pool: list[tuple], batch_tokens: int, rng: random.Random):
    pool = sorted(pool, key=lambda s: len(s[0]))
    out, cur = [], []
    for smp in pool:
        if cur and (len(cur) + 1) * len(smp[0]) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(smp)
    out += [cur] if cur else []
    rng.shuffle(out)
    return out


def pad(batch):
    t = max(len(s[0]) for s in batch)
    h = batch[0][1].shape[1]
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    hid = torch.zeros(len(batch), t, h)
    tgt = torch.zeros(len(batch), t, dtype=torch.long)
    w = torch.zeros(len(batch), t)
    for i, (x, hh, ww) in enumerate(batch):
        n = len(x)
        ids[i, :n], hid[i, :n], w[i, :n] = x, hh, ww
        tgt[i, :n - 1] = x[1:]
    return ids, hid, tgt, w


def export(block: MtpBlock, src: Path, dst: Path) -> None:
    """The shipped GGUF with the block after the trunk, as llama.cpp's converter writes one (2-D tensors F16 like the
    rest of the file, norms F32; the head and embedding shared, so none of the optional nextn tensors)."""
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    blocks = int(r.fields[f"{arch}.block_count"].contents())
    w = gguf.GGUFWriter(str(dst), arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == f"{arch}.block_count":
            value = blocks + 1
        if name == RECURRENT_LAYERS_KEY.format(arch=arch):
            value = list(value) + [False]
        if field.types[0] == GGUFValueType.ARRAY:
            w.add_key_value(name, value, field.types[0], sub_type=field.types[-1])
        else:
            w.add_key_value(name, value, field.types[0])
    w.add_key_value(NEXTN_KEY.format(arch=arch), 1, GGUFValueType.UINT32)
    for t in r.tensors:
        data = np.array(t.data)
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(t.name, data)
        else:
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    c = block.c
    nh, nkv, hd = c.num_attention_heads, c.num_kv_heads, c.head_dim
    q, k, v = block.qkv.detach().split([nh * 2 * hd, nkv * hd, nkv * hd], 0)
    gate, up = block.gate_up.detach().chunk(2, 0)
    p = f"blk.{blocks}."
    tensors = {
        "attn_norm.weight": block.attn_norm, "post_attention_norm.weight": block.post_norm,
        "attn_q.weight": q, "attn_k.weight": k, "attn_v.weight": v, "attn_output.weight": block.o,
        "attn_q_norm.weight": block.q_norm, "attn_k_norm.weight": block.k_norm,
        "ffn_gate.weight": gate, "ffn_up.weight": up, "ffn_down.weight": block.down,
        "nextn.eh_proj.weight": block.eh_proj, "nextn.enorm.weight": block.enorm, "nextn.hnorm.weight": block.hnorm,
        "nextn.shared_head_norm.weight": block.head_norm,
    }
    for name, t in tensors.items():
        t = t.detach().float().contiguous()
        w.add_tensor(p + name, t.numpy() if t.dim() == 1 else t.to(torch.float16).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def acceptance(path: Path, convs: int, seed: int) -> dict:
    """Greedy turns of held-out recall conversations with drafts (4 at most, no adaptation) and without: the output
    equal, and how many drafts the model kept."""
    import deltaserve

    model = deltaserve.load(path)
    rng = random.Random(seed)
    drafted = accepted = generated = 0
    same = True
    for _ in range(convs):
        turns, _ = C.recall_conversation(rng, "eval")
        messages = C.messages_of(turns)[:-1]
        s = model.session(mtp=4, quiet=True)
        s._policy.choose = lambda room: min(4, room)
        a = s.chat(messages, max_tokens=64, enable_thinking=False)
        b = model.session(mtp=0, quiet=True).chat(messages, max_tokens=64, enable_thinking=False)
        same = same and a.tokens == b.tokens
        drafted += a.drafted
        accepted += a.accepted
        generated += a.generated
    return {"conversations": convs, "generated": generated, "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / max(drafted, 1), "greedy_output_identical": same}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--base", type=Path, default=INSTALL, help="the demo GGUF whose trunk the block learns (shipped)")
    ap.add_argument("--minutes", type=float, default=12.0)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--batch-tokens", type=int, default=6144)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--install", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    host = load_host(a.base, "exact")
    if host.weights.mtp is not None:
        raise SystemExit(f"{a.base} carries an MTP block already: train from a file without one")
    backend = CPUBackend(host)
    backend.start()
    t0 = time.perf_counter()
    rng = random.Random(a.seed)
    pool = samples(host, backend.forward, rng, a.samples)
    held_out = samples(host, backend.forward, random.Random(a.seed + 1), 200, "eval")
    print(f"{len(pool)} training conversations ({sum(len(s[0]) for s in pool)} tokens) and {len(held_out)} held out, "
          f"trunk rows in {time.perf_counter() - t0:.0f} s", flush=True)
    block = MtpBlock(host)
    params = [p for p in block.parameters()]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    log: dict = {"args": {k: str(v) for k, v in vars(a).items()}, "steps": []}

    def evaluate() -> dict:
        with torch.no_grad():
            hits = total = 0.0
            loss = 0.0
            for b in batches(held_out, a.batch_tokens, random.Random(0)):
                ids, hid, tgt, w = pad(b)
                logits = block(ids, hid)
                mask = w >= 1.0
                hits += float(((logits.argmax(-1) == tgt) & mask).sum())
                total += float(mask.sum())
                loss += float((F.cross_entropy(logits.transpose(1, 2), tgt, reduction="none") * mask).sum())
        return {"top1_on_answers": hits / max(total, 1), "loss": loss / max(total, 1)}

    deadline = time.perf_counter() + a.minutes * 60
    step, epoch = 0, 0
    est_steps = None
    while time.perf_counter() < deadline:
        for b in batches(pool, a.batch_tokens, rng):
            if time.perf_counter() >= deadline:
                break
            ids, hid, tgt, w = pad(b)
            if est_steps:
                lr = a.lr * 0.5 * (1 + math.cos(math.pi * min(step / est_steps, 1.0)))
            else:
                lr = a.lr * min(1.0, (step + 1) / 30)
            for group in opt.param_groups:
                group["lr"] = lr
            logits = block(ids, hid)
            loss = (F.cross_entropy(logits.transpose(1, 2), tgt, reduction="none") * w).sum() / w.sum()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if step == 30:  # the cosine schedule fitted to the time left from the seconds a step takes
                per = (time.perf_counter() - (deadline - a.minutes * 60)) / 30
                est_steps = int(a.minutes * 60 / per)
            if step % 100 == 0:
                ev = evaluate()
                log["steps"].append({"step": step, "train_loss": float(loss.detach()), **ev})
                print(f"step {step} epoch {epoch} lr {lr:.2e} loss {float(loss.detach()):.3f} held-out {ev}", flush=True)
        epoch += 1
    final = evaluate()
    log["final"] = {"steps": step, "epochs": epoch, **final}
    out = a.out / "demo-qwen35-mtp.gguf"
    export(block, a.base, out)
    # the export read back by deltaserve: its MTP logits against the training module's on a held-out sample
    check_host = load_host(out, "exact")
    cb = CPUBackend(check_host)
    cb.start()
    ids, hidden, _ = held_out[0]
    cache = cb.forward.mtp.new_cache(len(ids) + 1)
    with torch.no_grad():
        ref = block(ids[None], hidden[None])[0]
    worst = 0.0
    for p in range(len(ids)):
        logits, _ = cb.forward.mtp.rows(cache, p, [int(ids[p])], hidden[p:p + 1], logits=True)
        worst = max(worst, float((logits - ref[p]).abs().max()))
    log["export_max_logit_difference"] = worst  # f16 weights against the f32 module
    print(f"export read back: largest logit difference {worst:.4f} (the file's f16 weights)", flush=True)
    log["acceptance"] = acceptance(out, 40, a.seed + 2)
    print(f"greedy acceptance on held-out conversations: {log['acceptance']}", flush=True)
    (a.out / "mtp_training_log.json").write_text(json.dumps(log, indent=1))
    if a.install:
        INSTALL.write_bytes(out.read_bytes())
        LOG.write_text(json.dumps(log, indent=1))
        print(f"installed {INSTALL} and {LOG}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
