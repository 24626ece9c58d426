"""Models by name on the command line: a MODEL argument that names a Hub repository (OWNER/REPO[:QUANT]) resolved
to files in the cache before a command runs, and `deltaserve pull | list | rm`."""

from __future__ import annotations

import sys

from deltaserve.errors import DeltaserveError
from deltaserve.hub import Hub, is_hub_name, size_said


def resolve_args(a) -> None:
    """The one place a command's MODEL becomes a local path: a Hub name is planned for, downloaded where it is not
    in the cache, and replaced by its file (or directory); its projector becomes --mmproj unless one was given, and
    the name is the one `serve` reports unless --model-name says another."""
    name = getattr(a, "model", None)
    if getattr(a, "command", None) in ("pull", "rm") or not is_hub_name(name):
        return  # pull and rm take the name itself
    got = Hub().resolve(name, positions=getattr(a, "ctx", None))
    a.model = str(got.path)
    if got.mmproj is not None:
        if getattr(a, "mmproj", None):
            print(f"[deltaserve] --mmproj {a.mmproj} given: the repository's projector {got.mmproj.name} is not used",
                  file=sys.stderr)
        elif hasattr(a, "mmproj"):
            a.mmproj = str(got.mmproj)
    if hasattr(a, "model_name") and not a.model_name:
        a.model_name = name


def cmd_pull(a) -> int:
    if not is_hub_name(a.model):
        raise DeltaserveError(f"{a.model!r} is not a Hub model name: expected OWNER/REPO or OWNER/REPO:QUANT "
                              "(a local file or directory needs no pull)")
    got = Hub().resolve(a.model, positions=a.ctx)
    print(f"{a.model}: {got.path}" + (f" (projector {got.mmproj})" if got.mmproj else "")
          + f", {size_said(got.size)}")
    return 0


def cmd_list(a) -> int:
    hub = Hub()
    models = hub.cached()
    if not models:
        print(f"no models in the cache ({hub.cache_dir}): `deltaserve pull OWNER/REPO[:QUANT]` fetches one")
        return 0
    rows = [("NAME", "SIZE", "ARCH", "QUANT", "")] + [
        (m.name, size_said(m.size), m.arch, m.quant,
         ("" if m.complete else "incomplete ") + ("+ mmproj" if m.projector else "")) for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + ("  " + r[4] if r[4] else ""))
    print(f"({hub.cache_dir})")
    return 0


def cmd_rm(a) -> int:
    for line in Hub().remove(a.model):
        print(line)
    return 0


def add_commands(sub, add_model, positive_int) -> None:
    """pull, list and rm on the CLI's subparsers."""
    p = sub.add_parser("pull", help="download a model from the Hugging Face Hub into the cache",
                       description="Download OWNER/REPO[:QUANT] from the Hugging Face Hub (huggingface_hub's cache, "
                                   "HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE) once its capacity plan fits this "
                                   "machine's memory: the GGUF of that quant (no QUANT: the largest that fits), "
                                   "every part of a split one, and the repository's mmproj-*.gguf; an HF checkpoint "
                                   "where the repository has no GGUF.")
    p.add_argument("model", metavar="OWNER/REPO[:QUANT]", help="a Hub repository, and a quant tag of its GGUF files "
                                                              "(case-insensitive)")
    p.add_argument("--ctx", type=positive_int, default=None,
                   help="plan memory for this many positions (default 4096, a session's first state)")
    p.set_defaults(func=cmd_pull)
    ls = sub.add_parser("list", help="the models in the Hugging Face cache",
                        description="List the models in the Hugging Face cache (HF_HOME / HF_HUB_CACHE): name, "
                                    "size, architecture and quant.")
    ls.set_defaults(func=cmd_list)
    rm = sub.add_parser("rm", help="remove a model from the Hugging Face cache",
                        description="Remove OWNER/REPO:QUANT (that quant's files) or OWNER/REPO (the whole "
                                    "repository) from the Hugging Face cache.")
    rm.add_argument("model", metavar="OWNER/REPO[:QUANT]",
                    help="a model in the cache: OWNER/REPO:QUANT removes that quant's files, OWNER/REPO the whole "
                         "repository")
    rm.set_defaults(func=cmd_rm)
