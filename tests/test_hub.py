"""Models by name (deltaserve.hub, `deltaserve run|pull|list|rm OWNER/REPO[:QUANT]`) against a local stand-in of the
Hugging Face Hub's HTTP API (tests/hub_standin.py) serving the fixture models: huggingface_hub itself does every
transfer, pointed at the stand-in by HF_ENDPOINT (the commands) or by the Hub object's endpoint (in process); the
cache is under each test's tmp dir (HF_HOME)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

import deltaserve
from deltaserve.errors import CapacityError, DeltaserveError
from deltaserve.hub import HEADER_BYTES, Hub, RepoFiles, is_hub_name, quant_of
from tests.fixtures import models as fx
from tests.hub_standin import StandInHub
from tests.server_proc import ServerProcess

GGUF_REPO = "deltaserve-tests/hybrid-GGUF"
HUGE = 4 << 40  # the size the listing claims for the BF16 file: no machine here holds it


def split_gguf(src: Path, out_dir: Path, stem: str, tensors_per_part: int) -> list[Path]:
    """`src` rewritten as a split GGUF by gguf's own writer (llama.cpp's format: `split.no`, `split.count`,
    `split.tensors.count`; NAME-00001-of-0000N.gguf), its parts in order."""
    import gguf
    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    from tests.gguf_edit import add_tensor, finish

    r = GGUFReader(src)
    w = gguf.GGUFWriter(str(out_dir / f"{stem}.gguf"), r.fields["general.architecture"].contents(),
                        split_max_tensors=tensors_per_part)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = f.types[0]
        w.add_key_value(name, f.contents(), kind, **({"sub_type": f.types[-1]} if kind == GGUFValueType.ARRAY else {}))
    for t in r.tensors:
        add_tensor(w, t.name, np.array(t.data), t.tensor_type)
    finish(w)
    return sorted(out_dir.glob(f"{stem}-*-of-*.gguf"))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The stand-in with its repositories: GGUFs of three quants (the BF16 one claimed too large to fit), a split
    GGUF, an HF checkpoint with a file the checkpoint does not need, a gated repository."""
    work = tmp_path_factory.mktemp("hub-files")
    f32, q8 = fx.gguf_path("hybrid", "f32"), fx.gguf_path("hybrid", "q8_0")
    server = StandInHub()
    server.add(GGUF_REPO, {"hybrid-Q8_0.gguf": q8, "hybrid-F32.gguf": f32, "hybrid-BF16.gguf": f32,
                           "README.md": b"# a test model\n"}, claimed={"hybrid-BF16.gguf": HUGE})
    parts = split_gguf(q8, work, "hybrid-Q8_0", 12)
    server.add("deltaserve-tests/split-GGUF", {**{f"Q8_0/{p.name}": p for p in parts}, "hybrid-F32.gguf": f32})
    hf = fx.hf_dir("hybrid")
    server.add("deltaserve-tests/hybrid", {**{p.name: p for p in hf.iterdir() if p.is_file() and
                                              not p.name.startswith(".")},
                                           "original/consolidated.pth": b"not needed" * 100})
    server.add("deltaserve-tests/gated-GGUF", {"hybrid-Q8_0.gguf": q8}, gated=True)
    server.parts = parts
    yield server
    server.stop()


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "hf" / "hub"


def in_process(hub: StandInHub, cache: Path, said: list | None = None, offline: bool = False) -> Hub:
    return Hub(endpoint=hub.url, cache_dir=cache, offline=offline,
               say=(said.append if said is not None else lambda line: None))


def cli(hub: StandInHub, tmp_path: Path, *args: str, offline: bool = False, token: str | None = None,
        timeout: int = 300) -> subprocess.CompletedProcess:
    """A deltaserve command with the stand-in as HF_ENDPOINT and the cache under tmp_path/hf (HF_HOME); its progress
    bars drawn on the captured stderr as on a terminal (TQDM_POSITION=-1: huggingface_hub's switch for that)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1", TQDM_POSITION="-1")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if token:
        env["HF_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "deltaserve", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_a_name_that_reads_as_a_path_is_never_sent_to_the_hub(tmp_path):
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "model").write_bytes(b"x")
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert not is_hub_name("owner/model")  # it exists here
    finally:
        os.chdir(here)
    assert is_hub_name("unsloth/Qwen3.5-35B-A3B-GGUF:Q4_K_M") and is_hub_name("Qwen/Qwen3.5-0.8B")
    for text in ("./a/b", "/abs/model.gguf", "~/m/x", "a/b/c", "models/x.gguf", "model.gguf", "a/b:c:d", None):
        assert not is_hub_name(text), text


def test_the_quant_is_read_from_a_ggufs_name_and_the_projector_preferred_is_f16():
    assert quant_of("Qwen3.5-35B-A3B-UD-Q4_K_XL.gguf") == "UD-Q4_K_XL"
    assert quant_of("BF16/Qwen3.5-35B-A3B-BF16-00001-of-00002.gguf") == "BF16"
    assert quant_of("qwen3.5-0.8b-iq2_xxs.gguf") == "iq2_xxs"
    assert quant_of("Qwen3.5-9B-MXFP4_MOE.gguf") == "MXFP4_MOE"
    files = RepoFiles("o/r", {"m-Q4_K_M.gguf": 5, "mmproj-F32.gguf": 3, "mmproj-F16.gguf": 2, "mmproj-BF16.gguf": 2,
                              "UD/m-UD-Q4_K_XL-00001-of-00002.gguf": 4, "UD/m-UD-Q4_K_XL-00002-of-00002.gguf": 4,
                              "mtp-m-Q8_0.gguf": 1})
    assert files.projector() == "mmproj-F16.gguf"
    choices = files.choices()
    assert [(c.quant, c.size, len(c.files)) for c in choices] == [("Q4_K_M", 5, 1),
                                                                  ("UD-Q4_K_XL", 8, 2)]
    assert choices[1].matches("q4_k_xl") and not choices[0].matches("q4_k_s")


def test_a_quant_tag_picks_its_gguf_whatever_its_case_and_the_model_answers(hub, tmp_path):
    start = len(hub.log)
    proc = cli(hub, tmp_path, "run", f"{GGUF_REPO}:q8_0", "--raw", "-p", "Hello", "-n", "4")
    assert proc.returncode == 0, proc.stderr
    assert "[stats]" in proc.stderr and f"{GGUF_REPO}:Q8_0: 1 file" in proc.stderr
    fetched = {r.path.rsplit("/", 1)[-1] for r in hub.log[start:]
               if r.method == "GET" and r.range is None and r.path.startswith("/cdn/")}
    assert fetched == {"hybrid-Q8_0.gguf"}  # the other quants are not downloaded
    (got,) = (tmp_path / "hf" / "hub").glob("models--*/snapshots/*/hybrid-Q8_0.gguf")
    assert sha256(got) == sha256(fx.gguf_path("hybrid", "q8_0"))


def test_no_tag_takes_the_largest_quant_that_fits_this_machine_and_says_so(hub, cache):
    said: list[str] = []
    got = in_process(hub, cache, said).resolve(GGUF_REPO)
    assert got.quant == "F32" and got.path.name == "hybrid-F32.gguf"
    assert any(line.startswith(f"no quant named: {GGUF_REPO}:F32") and "largest" in line and "BF16 (4096.0 GiB)" in line
               for line in said), said


def test_a_model_that_does_not_fit_is_refused_with_the_numbers_before_its_weights_are_fetched(hub, cache):
    start = len(hub.log)
    with pytest.raises(CapacityError) as e:
        in_process(hub, cache).resolve(f"{GGUF_REPO}:bf16")
    said = str(e.value)
    assert f"{GGUF_REPO}:BF16 (4096.0 GiB) does not fit" in said and "nothing was downloaded" in said
    assert f"weights {HUGE >> 20} MiB" in said and "MiB free of" in said
    asked = [r for r in hub.log[start:] if r.path.endswith("hybrid-BF16.gguf")]
    # its header alone was asked for (a ranged GET from byte 0): no HEAD or whole transfer of the file
    assert asked and all(r.method == "GET" and r.range == f"bytes=0-{HEADER_BYTES - 1}" for r in asked)
    assert not list(cache.glob("**/hybrid-BF16.gguf")) and not list(cache.glob("**/*.incomplete"))


def test_every_part_of_a_split_gguf_comes_and_loads_as_one_model(hub, cache):
    got = in_process(hub, cache).resolve("deltaserve-tests/split-GGUF:Q8_0")
    parts = sorted(got.path.parent.glob("hybrid-Q8_0-*-of-*.gguf"))
    assert got.path.name == "hybrid-Q8_0-00001-of-00005.gguf" and len(parts) == 5 == len(hub.parts)
    assert [sha256(p) for p in parts] == [sha256(p) for p in hub.parts]
    whole = deltaserve.load(fx.gguf_path("hybrid", "q8_0"), cache=False)
    split = deltaserve.load(got.path, cache=False)
    ids = [5, 17, 99, 3, 250]
    assert torch.equal(split.logits(ids), whole.logits(ids))
    assert split.host.file_bytes == sum(p.stat().st_size for p in parts)


def test_a_download_cut_partway_resumes_where_it_stopped(hub, cache, monkeypatch):
    """huggingface_hub writes what arrives in chunks (10 MiB) and, when the connection drops, asks for the rest from
    the end of the last whole chunk: the chunk scaled down to the fixture's size (64 KiB) shows the ranged resume."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 << 10)
    name = "hybrid-F32.gguf"
    size = fx.gguf_path("hybrid", "f32").stat().st_size
    hub.cut[name] = 300_000
    start = len(hub.log)
    got = in_process(hub, cache).resolve("deltaserve-tests/split-GGUF:F32")
    gets = [r for r in hub.log[start:] if r.method == "GET" and r.path.endswith(name) and r.path.startswith("/cdn/")]
    body = [r for r in gets if r.range != f"bytes=0-{HEADER_BYTES - 1}"]  # the header's read aside
    kept = 4 * (64 << 10)  # the whole chunks of the 300,000 bytes that came
    assert [(r.range, r.sent) for r in body] == [(None, 300_000), (f"bytes={kept}-", size - kept)]
    assert sha256(got.path) == sha256(fx.gguf_path("hybrid", "f32"))


def test_an_hf_checkpoint_is_fetched_when_the_repository_has_no_gguf(hub, cache):
    said: list[str] = []
    got = in_process(hub, cache, said).resolve("deltaserve-tests/hybrid")
    assert got.path.is_dir() and (got.path / "config.json").exists() and not (got.path / "original").exists()
    assert any("an HF checkpoint (no GGUF files)" in line for line in said)
    model = deltaserve.load(got.path, cache=False)
    ids = [5, 17, 99]
    assert torch.allclose(model.logits(ids), deltaserve.load(fx.hf_dir("hybrid"), cache=False).logits(ids))
    with pytest.raises(DeltaserveError, match="holds no GGUF files .* so it has no quant Q4_K_M"):
        in_process(hub, cache).resolve("deltaserve-tests/hybrid:Q4_K_M")


def test_a_missing_repository_is_one_line_naming_it_and_the_hub_asked(hub, tmp_path):
    proc = cli(hub, tmp_path, "run", "nobody/nothing-GGUF", "-p", "hi", "-n", "2")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert re.fullmatch(r"deltaserve: error: no model repository nobody/nothing-GGUF on http://127\.0\.0\.1:\d+ \(or it "
                        r"is private and no HF_TOKEN is set\), and no file or directory nobody/nothing-GGUF here: "
                        r"check the name, OWNER/REPO as on its page", line), line


@pytest.mark.parametrize("name, message", [
    (f"{GGUF_REPO}:Q4_K_M", rf"{GGUF_REPO} has no GGUF of the quant Q4_K_M: it has Q8_0 \(0\.3 MiB\), F32 \(1\.0 MiB\), "
                            r"BF16 \(4096\.0 GiB\)$"),
    ("deltaserve-tests/gated-GGUF", r"^deltaserve-tests/gated-GGUF is a gated repository: accept its terms on "
                                    r"http://127\.0\.0\.1:\d+/deltaserve-tests/gated-GGUF while signed in, then set "
                                    r"HF_TOKEN to a token of that account \(no HF_TOKEN is set\)$"),
])
def test_a_missing_quant_lists_those_there_are_and_a_gated_repository_names_HF_TOKEN(hub, cache, monkeypatch, name,
                                                                                       message):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(DeltaserveError) as e:
        in_process(hub, cache).resolve(name)
    assert re.search(message, str(e.value)), str(e.value)
    assert not list(cache.glob("**/*.gguf"))


def test_a_gated_repository_downloads_with_the_token_in_HF_TOKEN(hub, cache, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", hub.token)  # huggingface_hub reads it when it asks
    got = in_process(hub, cache).resolve("deltaserve-tests/gated-GGUF")
    assert sha256(got.path) == sha256(fx.gguf_path("hybrid", "q8_0"))


def test_offline_a_cached_model_is_served_by_its_name_without_the_network_and_list_and_rm_keep_the_cache(tmp_path):
    """Pulled while the stand-in answers; then, the stand-in gone, HF_HUB_OFFLINE=1 serves it from the cache by its
    name (the name its /v1/models reports), a quant not cached is named with those that are; list shows it; rm
    removes it."""
    server = StandInHub()
    server.add(GGUF_REPO, {"hybrid-Q8_0.gguf": fx.gguf_path("hybrid", "q8_0"),
                           "hybrid-F32.gguf": fx.gguf_path("hybrid", "f32")})
    try:
        pulled = cli(server, tmp_path, "pull", f"{GGUF_REPO}:Q8_0")
        assert pulled.returncode == 0, pulled.stderr
        assert "hybrid-Q8_0.gguf" in pulled.stdout and "%|" in pulled.stderr  # huggingface_hub's progress bar
    finally:
        server.stop()
    env = {"HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    with ServerProcess(GGUF_REPO, "--slots", "1", env=env) as served:  # by name, no tag: among the cached ones
        assert f"no quant named: {GGUF_REPO}:Q8_0 (0.3 MiB) is the largest of its 1 GGUFs" in served.stderr
        assert httpx.get(served.url + "/v1/models").json()["data"][0]["id"] == GGUF_REPO
        answer = httpx.post(served.url + "/v1/chat/completions", timeout=60,
                            json={"model": GGUF_REPO, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] > 0
    missing = cli(server, tmp_path, "run", f"{GGUF_REPO}:F32", "-p", "hi", offline=True)
    assert missing.returncode == 1
    assert (f"{GGUF_REPO} has no GGUF of the quant F32 in the cache (HF_HUB_OFFLINE is set): it has Q8_0 (0.3 MiB)"
            in missing.stderr), missing.stderr
    listed = cli(server, tmp_path, "list", offline=True)
    row = next(line for line in listed.stdout.splitlines() if line.startswith(f"{GGUF_REPO}:Q8_0"))
    assert row.split()[1:4] == ["0.3", "MiB", "qwen35"] and row.split()[4] == "Q8_0"
    removed = cli(server, tmp_path, "rm", f"{GGUF_REPO}:q8_0", offline=True)
    assert removed.returncode == 0 and f"removed {GGUF_REPO}:Q8_0 (0.3 MiB)" in removed.stdout, removed.stderr
    assert "no model left" in removed.stdout and not list((tmp_path / "hf" / "hub").glob("models--*"))


def test_rm_of_one_quant_keeps_the_others_and_rm_of_the_repository_removes_all(hub, cache):
    h = in_process(hub, cache)
    h.resolve(f"{GGUF_REPO}:Q8_0")
    h.resolve(f"{GGUF_REPO}:F32")
    assert sorted(m.name for m in h.cached()) == [f"{GGUF_REPO}:F32", f"{GGUF_REPO}:Q8_0"]
    assert h.remove(f"{GGUF_REPO}:F32") == [f"removed {GGUF_REPO}:F32 (1.0 MiB)"]
    assert [m.name for m in h.cached()] == [f"{GGUF_REPO}:Q8_0"]
    with pytest.raises(DeltaserveError, match=f"{GGUF_REPO} has no quant BF16 in the cache: it holds {GGUF_REPO}:Q8_0"):
        h.remove(f"{GGUF_REPO}:BF16")
    (said,) = h.remove(GGUF_REPO)
    assert said.startswith(f"removed {GGUF_REPO} (0.3 MiB") and h.cached() == []
    with pytest.raises(DeltaserveError, match=f"{GGUF_REPO} is not in the cache"):
        h.remove(GGUF_REPO)


@pytest.fixture(scope="module")
def projector(tmp_path_factory) -> Path:
    """The vision fixture's projector as llama.cpp's converter writes it (`--mmproj --outtype f16`), made once and
    kept with the fixtures."""
    from tests.test_mmproj import _llama_convert, _with_preprocessor

    out = fx.fixtures_dir() / f"{fx._key('vision')}" / "mmproj-F16.gguf"
    if not out.exists():
        with fx._locked(out):
            if not out.exists():
                work = tmp_path_factory.mktemp("projector")
                _llama_convert(_with_preprocessor(fx.hf_dir("vision"), work), {work / out.name: ["--mmproj",
                                                                                              "--outtype", "f16"]})
                (work / out.name).replace(out)
    return out


def test_the_repositorys_projector_comes_with_the_model_so_an_image_needs_no_flag(hub, tmp_path, projector):
    from tests.test_vision import _picture

    hub.add("deltaserve-tests/vision-GGUF", {"vision-F32.gguf": fx.gguf_path("vision", "f32"),
                                             "mmproj-F16.gguf": projector})
    picture = tmp_path / "picture.png"
    _picture(150, 90, 3).save(picture)
    proc = cli(hub, tmp_path, "run", "deltaserve-tests/vision-GGUF:F32", "--image", str(picture), "-p",
               "What is in this picture?", "-n", "3")
    assert proc.returncode == 0, proc.stderr
    assert "and the projector mmproj-F16.gguf for images" in proc.stderr and "[stats]" in proc.stderr
    (got,) = (tmp_path / "hf" / "hub").glob("models--*/snapshots/*/mmproj-F16.gguf")
    assert sha256(got) == sha256(projector)
    # the same file without its projector has nothing to see the image with
    alone = cli(hub, tmp_path, "run", str(got.parent / "vision-F32.gguf"), "--image", str(picture), "-p", "hi")
    assert alone.returncode == 1 and "this model has no vision encoder" in alone.stderr


def test_a_model_in_the_cache_is_planned_from_its_own_bytes_and_not_fetched_again(hub, cache):
    h = in_process(hub, cache)
    first = h.resolve(f"{GGUF_REPO}:Q8_0")
    start = len(hub.log)
    again = h.resolve(f"{GGUF_REPO}:Q8_0")
    assert again.path == first.path
    # the listing and huggingface_hub's check of the file's version: no byte of the file, its header included
    assert not [r for r in hub.log[start:] if r.method == "GET" and r.path.endswith("hybrid-Q8_0.gguf")]
