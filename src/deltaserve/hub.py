"""Models by name from the Hugging Face Hub: `OWNER/REPO[:QUANT]` resolved to files in huggingface_hub's cache.

huggingface_hub does the transfer and keeps the cache (its HF_HOME / HF_HUB_CACHE, HF_TOKEN, HF_ENDPOINT and
HF_HUB_OFFLINE, resumable downloads, progress bars); this module decides which files a name means and whether
they fit before any of them is fetched:

- a repository with GGUF files: the one whose name carries QUANT (case-insensitive; `UD-Q4_K_XL` answers to
  `Q4_K_XL` too), every part of a split GGUF (`NAME-00001-of-0000N.gguf`), and the repository's projector
  (`mmproj-*.gguf`) for images. Without QUANT: the largest that fits this machine's memory, said.
- a repository without GGUF files: an HF checkpoint (config.json, *.safetensors, the tokenizer's files).

The capacity plan (runtime/capacity.py) runs on the model's config read from the first bytes of the file (a ranged
request: the GGUF header) or from config.json, with the files' sizes as the Hub lists them; a model that does not
fit is refused with the arithmetic before its weights are downloaded. Offline (HF_HUB_OFFLINE=1) the same choice is
made among the files already in the cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from deltaserve.errors import CapacityError, DeltaserveError, ModelFormatError
from deltaserve.formats.config import HybridConfig
from deltaserve.formats.gguf import SPLIT_NAME, GGUFHeader, TruncatedHeader, architecture, read_header
from deltaserve.runtime import capacity

NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?::(?P<tag>[A-Za-z0-9_.-]+))?$")
# the quant a GGUF's name ends with: llama-quantize's presets (Q4_K_M, IQ2_XXS, Q8_0, TQ1_0, MXFP4_MOE, ...),
# the float types, and an uploader's prefix for its own mixes (UD-Q4_K_XL)
QUANT = re.compile(r"(?:^|[-_.])(?P<quant>(?:UD-)?(?:I?Q\d_[A-Z0-9]+(?:_[A-Z0-9]+)*|TQ\d_\d|B?F16|F32|MXFP4(?:_MOE)?"
                   r"|NVFP4))$", re.IGNORECASE)
# what an HF checkpoint directory needs (deltaserve.formats.hf, the tokenizer, the vision preprocessor)
HF_FILES = (".json", ".safetensors", ".jinja", ".txt", ".model")
MMPROJ_ORDER = ("F16", "BF16", "F32", "Q8_0")  # the projector picked when a repository has several
DEFAULT_POSITIONS = 4096  # planned when no --ctx is given: a session's first state (it grows by doubling)
HEADER_BYTES = 16 << 20  # a GGUF header's first request; the real Qwen3.5 vocabulary's header is ~11 MB
MiB, GiB = 1 << 20, 1 << 30


def is_hub_name(text: str | None) -> bool:
    """A MODEL argument that names a Hub repository: OWNER/REPO[:QUANT], not a path that exists here nor one that
    reads as a path (./x, /x, a/b/c, x.gguf)."""
    if not text or os.path.exists(text) or text.startswith((".", "/", "~")):
        return False
    m = NAME.match(text)
    return m is not None and not m["repo"].lower().endswith(".gguf")


def split_name(text: str) -> tuple[str, str | None]:
    m = NAME.match(text)
    if m is None:
        raise DeltaserveError(f"{text!r} is not a Hub model name: expected OWNER/REPO or OWNER/REPO:QUANT")
    return m["repo"], m["tag"]


def size_said(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def quant_of(filename: str) -> str:
    """The quant a GGUF's name carries ('Q4_K_M' of 'Qwen3.5-9B-Q4_K_M-00001-of-00002.gguf'), else its stem."""
    base = filename.rsplit("/", 1)[-1]
    m = SPLIT_NAME.match(base)
    stem = m["stem"] if m else base.removesuffix(".gguf")
    q = QUANT.search(stem)
    return q["quant"] if q else stem


@dataclass
class Choice:
    """One model among a repository's GGUF files: its quant and its files (the parts of a split one, in order)."""

    quant: str
    files: list[str]
    size: int

    def matches(self, tag: str) -> bool:
        q, t = self.quant.upper(), tag.upper()
        return q == t or (q.split("-", 1)[-1] == t and "-" in q)


@dataclass
class RepoFiles:
    """What a repository holds (path -> size), online from the Hub's listing or offline from the cache."""

    repo: str
    sizes: dict[str, int]
    revision: str | None = None
    snapshot: Path | None = None  # offline: the cached snapshot the files are in

    @property
    def ggufs(self) -> list[str]:
        return sorted(f for f in self.sizes if f.lower().endswith(".gguf"))

    @property
    def projectors(self) -> list[str]:
        return [f for f in self.ggufs if f.rsplit("/", 1)[-1].lower().startswith("mmproj")]

    def choices(self) -> list[Choice]:
        """The repository's GGUF models, one per (folder, name without the split suffix), smallest first; projectors
        and separate MTP blocks (mtp-*.gguf) are not models."""
        groups: dict[tuple[str, str], list[str]] = {}
        for f in self.ggufs:
            base = f.rsplit("/", 1)[-1]
            if base.lower().startswith(("mmproj", "mtp-")):
                continue
            m = SPLIT_NAME.match(base)
            if m is not None and int(m["count"]) > 1:
                key = (f.rsplit("/", 1)[0] if "/" in f else "", m["stem"])
            else:
                key = (f, "")
            groups.setdefault(key, []).append(f)
        out = [Choice(quant_of(files[0]), sorted(files), sum(self.sizes[f] for f in files)) for files in groups.values()]
        return sorted(out, key=lambda c: (c.size, c.quant))

    def projector(self) -> str | None:
        found = self.projectors
        for want in MMPROJ_ORDER:
            for f in found:
                if quant_of(f).upper() == want:
                    return f
        return found[0] if found else None


@dataclass
class Resolved:
    """A name resolved to local files: the model path to load (a GGUF's first part, or an HF directory) and the
    projector to pass with it."""

    name: str
    path: Path
    mmproj: Path | None = None
    quant: str | None = None
    size: int = 0


def hub_error(e: BaseException, repo: str, endpoint: str, what: str = "", offline: bool = False) -> DeltaserveError:
    """huggingface_hub's exceptions as one line a user can act on."""
    from huggingface_hub import errors as hfe

    token = "an HF_TOKEN was sent" if _token() else "no HF_TOKEN is set"
    if isinstance(e, hfe.GatedRepoError):
        return DeltaserveError(f"{repo} is a gated repository: accept its terms on {endpoint}/{repo} while signed in, "
                               f"then set HF_TOKEN to a token of that account ({token})")
    if isinstance(e, hfe.RepositoryNotFoundError):
        return DeltaserveError(f"no model repository {repo} on {endpoint} (or it is private and {token}), and no file "
                               f"or directory {repo} here: check the name, OWNER/REPO as on its page")
    if isinstance(e, hfe.RemoteEntryNotFoundError):
        return DeltaserveError(f"{repo} has no file {what}" if what else f"{repo}: {e}")
    if isinstance(e, hfe.OfflineModeIsEnabled) or (isinstance(e, hfe.LocalEntryNotFoundError) and offline):
        return DeltaserveError(f"{repo}{': ' + what if what else ''} is not in the cache and HF_HUB_OFFLINE is set "
                               "(`deltaserve list` shows the models there)")
    if isinstance(e, hfe.LocalEntryNotFoundError) and e.__cause__ is not None:
        e = e.__cause__  # the reason the Hub could not be asked (a connection refused, a timeout)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return DeltaserveError(f"cannot fetch {what or repo} from {endpoint}: {first} (a model downloaded before runs "
                           "offline with HF_HUB_OFFLINE=1)")


def _token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


class Hub:
    """The Hub at `endpoint` and the cache at `cache_dir` (default: huggingface_hub's, from HF_ENDPOINT, HF_HOME or
    HF_HUB_CACHE, HF_HUB_OFFLINE as the process started). `say` prints what is decided (stderr)."""

    def __init__(self, endpoint: str | None = None, cache_dir: str | os.PathLike | None = None,
                 offline: bool | None = None, say=None, memory=None):
        from huggingface_hub import constants

        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
        self.cache_dir = Path(cache_dir or constants.HF_HUB_CACHE)
        self.offline = constants.is_offline_mode() if offline is None else offline
        self.say = say or (lambda line: print(f"[deltaserve] {line}", file=sys.stderr, flush=True))
        self.memory = memory or capacity.cpu_memory  # what the plan compares with (a function: read when planned)

    # -- what a repository holds ---------------------------------------------------------------------------
    def files(self, repo: str) -> RepoFiles:
        if self.offline:
            return self.cached_files(repo)
        from huggingface_hub import HfApi

        try:
            info = HfApi(endpoint=self.endpoint).model_info(repo, files_metadata=True)
        except Exception as e:  # noqa: BLE001 - every Hub failure as one line
            raise hub_error(e, repo, self.endpoint) from None
        sizes = {s.rfilename: int(s.size or 0) for s in (info.siblings or [])}
        return RepoFiles(repo, sizes, info.sha)

    def repo_dir(self, repo: str) -> Path:
        return self.cache_dir / ("models--" + repo.replace("/", "--"))

    def cached_files(self, repo: str) -> RepoFiles:
        """The files of `repo`'s cached snapshot (the one refs/main names, else the newest)."""
        root = self.repo_dir(repo)
        snapshots = root / "snapshots"
        ref = root / "refs" / "main"
        snapshot = snapshots / ref.read_text().strip() if ref.is_file() else None
        if snapshot is None or not snapshot.is_dir():
            found = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
            snapshot = found[-1] if found else None
        if snapshot is None:
            raise DeltaserveError(f"{repo} is not in the cache ({self.cache_dir}) and HF_HUB_OFFLINE is set: "
                                  "`deltaserve list` shows the models there")
        sizes = {p.relative_to(snapshot).as_posix(): p.stat().st_size
                 for p in snapshot.rglob("*") if p.is_file()}
        return RepoFiles(repo, sizes, snapshot.name, snapshot)

    # -- fetching ---------------------------------------------------------------------------------------------
    def download(self, repo: str, filename: str) -> Path:
        """One file into the cache (huggingface_hub: resumable, with its progress bar; a cached one is not fetched
        again), its snapshot path."""
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(repo, filename, cache_dir=self.cache_dir, endpoint=self.endpoint,
                                        local_files_only=self.offline))
        except Exception as e:  # noqa: BLE001
            raise hub_error(e, repo, self.endpoint, filename, self.offline) from None

    def cached_path(self, repo: str, filename: str) -> Path | None:
        """The file of the cached snapshot refs/main names, where it is there."""
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, filename, cache_dir=self.cache_dir)
        return Path(found) if isinstance(found, str) else None

    def header(self, files: RepoFiles, filename: str) -> GGUFHeader:
        """A GGUF's header from the file's first bytes: the cached file where it is there, else ranged requests."""
        local = files.snapshot / filename if files.snapshot is not None else self.cached_path(files.repo, filename)
        if local is not None:  # in the cache already: its own first bytes, nothing fetched
            with open(local, "rb") as fh:
                head = fh.read(HEADER_BYTES)
            while True:
                try:
                    return read_header(head, filename)
                except TruncatedHeader:
                    with open(local, "rb") as fh:
                        head = fh.read(len(head) * 4)
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(files.repo, filename, endpoint=self.endpoint)
        total = files.sizes.get(filename) or 0
        want = HEADER_BYTES
        while True:
            try:
                r = get_session().get(url, headers={**build_hf_headers(), "Range": f"bytes=0-{want - 1}",
                                                    "Accept-Encoding": "identity"}, timeout=60)
                hf_raise_for_status(r)
            except Exception as e:  # noqa: BLE001
                raise hub_error(e, files.repo, self.endpoint, filename) from None
            try:
                return read_header(r.content, filename)
            except TruncatedHeader:
                if len(r.content) < want or (total and want >= total):
                    raise ModelFormatError(f"{files.repo}/{filename}: the file ends inside its GGUF header") from None
                want *= 4

    def config(self, files: RepoFiles, choice: Choice) -> HybridConfig:
        """The model's config from its GGUF header (the first part's; the embedding's rows from the part that
        holds it)."""
        head = self.header(files, choice.files[0])
        rows = head.tensors.get("token_embd.weight")
        for other in choice.files[1:]:
            if rows is not None:
                break
            rows = self.header(files, other).tensors.get("token_embd.weight")
        if rows is None:
            raise ModelFormatError(f"{files.repo}/{choice.files[0]}: no token_embd.weight in its header")
        return HybridConfig.from_gguf(head.metadata, rows[1][0], tied="output.weight" not in head.tensors)

    # -- the plan -----------------------------------------------------------------------------------------------
    def plan(self, config: HybridConfig, weights: int, positions: int | None) -> capacity.Plan:
        n = min(positions or DEFAULT_POSITIONS, config.context_length)
        return capacity.plan(config, n, self.memory(), weights=weights)

    # -- a name, resolved -----------------------------------------------------------------------------------------
    def resolve(self, name: str, positions: int | None = None) -> Resolved:
        """The local files `name` (OWNER/REPO[:QUANT]) means, downloaded where they are not in the cache, once the
        capacity plan for `positions` (default: a first state of 4096) fits."""
        repo, tag = split_name(name)
        files = self.files(repo)
        if files.ggufs:
            return self._gguf(name, repo, tag, files, positions)
        if "config.json" in files.sizes and any(f.endswith(".safetensors") for f in files.sizes):
            if tag:
                raise DeltaserveError(f"{repo} holds no GGUF files (it is an HF checkpoint: config.json and "
                                      f"safetensors), so it has no quant {tag}: name it as {repo}")
            return self._checkpoint(name, repo, files, positions)
        held = ", ".join(sorted(files.sizes)[:8]) + (" ..." if len(files.sizes) > 8 else "")
        raise DeltaserveError(f"{repo} holds neither GGUF files nor an HF checkpoint (config.json and *.safetensors)"
                              + (f": it has {held}" if held else ": it is empty"))

    def _gguf(self, name: str, repo: str, tag: str | None, files: RepoFiles, positions: int | None) -> Resolved:
        choices = files.choices()
        if not choices:
            raise DeltaserveError(f"{repo} holds only projector files ({', '.join(files.projectors)}), no model GGUF")
        listed = ", ".join(f"{c.quant} ({size_said(c.size)})" for c in choices)
        projector = files.projector()
        extra = files.sizes[projector] if projector else 0
        if tag:
            picked = [c for c in choices if c.quant.upper() == tag.upper()] or [c for c in choices if c.matches(tag)]
            if not picked:
                where = " in the cache (HF_HUB_OFFLINE is set)" if self.offline else ""
                raise DeltaserveError(f"{repo} has no GGUF of the quant {tag}{where}: it has {listed}")
            choice = picked[0]
            config = self.config(files, choice)
            try:
                plan = self.plan(config, choice.size + extra, positions)
            except CapacityError as e:
                raise CapacityError(f"{repo}:{choice.quant} ({size_said(choice.size)}) does not fit this machine's "
                                    f"memory, so nothing was downloaded: {e}") from None
        else:
            config = self.config(files, choices[0])  # one model: every quant has the same shape
            fits = []
            for c in choices:
                try:
                    fits.append((c, self.plan(config, c.size + extra, positions)))
                except CapacityError as e:
                    last = e
            if not fits:
                raise CapacityError(f"none of {repo}'s GGUFs fits this machine's memory, so nothing was downloaded "
                                    f"(it has {listed}); the smallest, {choices[0].quant}: {last}") from None
            choice, plan = fits[-1]
            self.say(f"no quant named: {repo}:{choice.quant} ({size_said(choice.size)}) is the largest of its "
                     f"{len(choices)} GGUFs ({listed}) that fits this machine's memory; name another as "
                     f"{repo}:QUANT")
        self.say(f"{repo}:{choice.quant}: {len(choice.files)} file{'s' if len(choice.files) > 1 else ''}, "
                 f"{size_said(choice.size)}" + (f", and the projector {projector} for images" if projector else "")
                 + f"; the plan fits: {plan.arithmetic()}")
        local = [self.download(repo, f) for f in choice.files]
        mmproj = self.download(repo, projector) if projector else None
        return Resolved(name, local[0], mmproj, choice.quant, choice.size + extra)

    def _checkpoint(self, name: str, repo: str, files: RepoFiles, positions: int | None) -> Resolved:
        config_path = self.download(repo, "config.json")
        try:
            raw = json.loads(config_path.read_text())
        except ValueError as e:
            raise ModelFormatError(f"{repo}/config.json is not valid JSON: {e}") from None
        config = HybridConfig.from_hf(raw)
        wanted = [f for f in sorted(files.sizes) if f.endswith(HF_FILES) and "/" not in f]
        weights = sum(files.sizes[f] for f in wanted if f.endswith(".safetensors"))
        try:
            plan = self.plan(config, weights, positions)
        except CapacityError as e:
            raise CapacityError(f"{repo} ({size_said(weights)} of safetensors) does not fit this machine's memory, "
                                f"so nothing more was downloaded: {e}") from None
        self.say(f"{repo}: an HF checkpoint (no GGUF files), {len(wanted)} files, {size_said(weights)} of weights; "
                 f"the plan fits: {plan.arithmetic()}")
        for f in wanted:
            self.download(repo, f)
        return Resolved(name, config_path.parent, None, None, weights)

    # -- the cache ------------------------------------------------------------------------------------------------
    def cached(self) -> list["CachedModel"]:
        """Every model in the cache: one per GGUF model (quant) of a repository, one per HF checkpoint."""
        out: list[CachedModel] = []
        if not self.cache_dir.is_dir():
            return out
        for root in sorted(self.cache_dir.glob("models--*--*")):
            repo = root.name.removeprefix("models--").replace("--", "/", 1)
            try:
                files = self.cached_files(repo)
            except DeltaserveError:
                continue
            out.extend(cached_models(files))
        return out

    def remove(self, name: str) -> list[str]:
        """Delete `name` from the cache: a quant's files (its blobs too, where no other snapshot links them; the
        repository when no model is left in it), or the whole repository. What was removed, said."""
        repo, tag = split_name(name)
        root = self.repo_dir(repo)
        if not root.is_dir():
            held = ", ".join(m.name for m in self.cached()) or "nothing"
            raise DeltaserveError(f"{repo} is not in the cache ({self.cache_dir}); it holds {held}")
        files = self.cached_files(repo)
        models = cached_models(files)
        if tag is None:
            size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())
            shutil.rmtree(root)
            return [f"removed {repo} ({size_said(size)}: {', '.join(m.name for m in models) or 'no model'})"]
        quants = [m for m in models if m.choice is not None]
        match = [m for m in quants if m.quant.upper() == tag.upper()] or [m for m in quants if m.choice.matches(tag)]
        if not match:
            raise DeltaserveError(f"{repo} has no quant {tag} in the cache: it holds "
                                  f"{', '.join(m.name for m in models) or 'no model'}")
        m, freed = match[0], 0
        for f in m.choice.files:
            link = files.snapshot / f
            blob = link.resolve()
            link.unlink(missing_ok=True)
            linked = any(p.resolve() == blob for p in root.glob("snapshots/*/**/*") if p.is_symlink())
            if blob.exists() and not linked:  # no other snapshot links it
                freed += blob.stat().st_size
                blob.unlink()
        said = [f"removed {m.name} ({size_said(freed)})"]
        left = RepoFiles(repo, {p.relative_to(files.snapshot).as_posix(): 0
                                for p in files.snapshot.rglob("*") if p.is_file()})
        if not left.choices():  # a projector or a README alone is no model: the repository goes too
            shutil.rmtree(root)
            said.append(f"no model left in {repo}: removed it from the cache")
        return said


@dataclass
class CachedModel:
    name: str           # OWNER/REPO:QUANT, or OWNER/REPO for a checkpoint
    size: int
    arch: str
    quant: str
    path: Path
    complete: bool = True
    choice: Choice | None = None
    projector: str | None = None


def cached_models(files: RepoFiles) -> list[CachedModel]:
    out = []
    projector = files.projector()
    for c in files.choices():
        first = files.snapshot / c.files[0]
        parts = [files.snapshot / f for f in c.files]
        m = SPLIT_NAME.match(first.name)
        complete = (m is None or int(m["count"]) == len(parts)) and all(p.exists() for p in parts)
        try:
            arch = str(architecture(first))
        except (OSError, ModelFormatError):
            arch = "?"
        out.append(CachedModel(f"{files.repo}:{c.quant}", c.size, arch, c.quant, first, complete, c, projector))
    if not out and "config.json" in files.sizes:
        try:
            raw = json.loads((files.snapshot / "config.json").read_text())
            arch = (raw.get("architectures") or [raw.get("model_type", "?")])[0]
            text = raw.get("text_config", raw)
            dtype = text.get("dtype") or text.get("torch_dtype") or raw.get("torch_dtype") or "safetensors"
        except (OSError, ValueError, AttributeError):
            arch, dtype = "?", "safetensors"
        size = sum(s for f, s in files.sizes.items() if f.endswith(".safetensors"))
        out.append(CachedModel(files.repo, size, str(arch), f"safetensors ({dtype})", files.snapshot,
                               size > 0))
    return out
