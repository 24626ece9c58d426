"""`deltaserve chat`: a conversation on one resident session.

Each turn renders the whole history with the model's template; the session prefills only what its state
does not already hold. Commands: /clear, /system TEXT, /regenerate, /think on|off, /image FILE, /stats, /help, /quit.
Multi-line input: end a line with a backslash to continue, or wrap a block in triple quotes.

`--resume NAME` keeps the conversation under a name, in the data directory (`chats/NAME.json`: the messages,
the system message, the thinking setting, the model's sha256, deltaserve's version; `chats/NAME.state`: the
session's checkpoint, `Session.save`), both rewritten atomically after every turn. A later `--resume NAME` with
the same model loads the messages, restores the state, and its next turn prefills only what is new. The data
directory ($DELTASERVE_DATA_DIR, `--data-dir`, else $XDG_DATA_HOME/deltaserve) is not the cache directory: clearing
the compiled kernels and the guard's verdicts never deletes a conversation. Chats an older deltaserve kept under the
cache directory are moved once, with a notice.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import stat
import sys
import time
from pathlib import Path

from deltaserve.api import MAX_AGE as GUARD_MAX_AGE
from deltaserve.api import cache_root, data_root
from deltaserve.errors import DeltaserveError
from deltaserve.frontends.common import load_model, loop_guard, sampling_kwargs, thinking_kwargs, thought_words
from deltaserve.api import plural
from deltaserve.api import files
from deltaserve.api import StateFileError, read_header
from deltaserve.session.turns import thinking_flag
from deltaserve.api import __version__

HELP = """commands:
  /clear          forget the conversation (keeps the system message; under --resume, the saved one too)
  /system TEXT    set the system message (clears the conversation)
  /regenerate     answer the last message again (resumes from the checkpoint)
  /think on|off   thinking in the chat template
  /image FILE     attach an image to your next message (a checkpoint with a vision encoder)
  /stats          the session: held tokens, capacity, checkpoint, backend, notices
  /help           this text
  /quit           leave (also Ctrl-D)
multi-line: end a line with \\ to continue it, or wrap a block in \"\"\" ... \"\"\""""


CHAT_FORMAT = "deltaserve-chat/1"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def check_name(name: str) -> str:
    """A conversation name: letters, digits, '-', '_', '.', starting with a letter or digit, at most 100."""
    if not _NAME.fullmatch(name or ""):
        raise DeltaserveError(f"--resume {name!r}: a conversation name is 1 to 100 letters, digits, '-', '_' or '.', "
                              f"starting with a letter or digit (no path separators), e.g. --resume work-notes")
    return name


def chats_dir(data_dir: str | os.PathLike | None = None) -> Path:
    return (Path(data_dir) if data_dir else data_root()) / "chats"


CHAT_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\.(json|state)")
MAX_CHAT_BYTES = 256 << 20


def move_old_chats(target: Path) -> list[str]:
    """Chats an older deltaserve saved under the cache directory (`cache_root()/chats`), moved once into `target`
    (their names' files that `target` does not already hold; only regular files named as chats, never through a
    symlink); what to say about it."""
    old = cache_root() / "chats"
    try:
        if not old.is_dir() or old.resolve() == target.resolve():
            return []
        entries = [e for e in os.scandir(old) if CHAT_FILE.fullmatch(e.name) or e.name == files.KEY_NAME]
    except OSError:
        return []
    if not entries:
        return []
    files.private_dir(target, "the chat data directory")
    moved, kept = [], []
    for e in entries:
        try:
            st = os.lstat(e.path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
            continue
        dest = target / e.name
        if dest.exists():
            kept.append(e.name)
            continue
        try:
            shutil.move(e.path, dest)
            moved.append(e.name)
        except OSError:
            kept.append(e.name)
    said = []
    if moved:
        said.append(f"[deltaserve] moved {len(moved)} saved chat file{'s' if len(moved) != 1 else ''} from the cache "
                    f"directory {old} to the data directory {target} (clearing a cache no longer deletes them)")
    if kept:
        said.append(f"[deltaserve] left {len(kept)} file{'s' if len(kept) != 1 else ''} in {old} that {target} "
                    f"already holds or that could not be moved ({', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''})")
    return said


def _short(sha: str | None) -> str:
    return f"{sha[:12]}..." if isinstance(sha, str) and sha else "unknown"


class SavedChat:
    """One named conversation on disk: NAME.json (the messages and what they belong to) and NAME.state (the
    session's checkpoint). Each is replaced atomically (a temporary file, fsynced, renamed over it); NAME.lock
    keeps a second `chat --resume NAME` from writing over this one's turns."""

    def __init__(self, name: str, directory: Path | None = None):
        self.name = check_name(name)
        self.dir = Path(directory) if directory is not None else chats_dir()
        self.json_path = self.dir / f"{name}.json"
        self.state_path = self.dir / f"{name}.state"
        self._lock_file = None

    def prepare(self) -> None:
        """Create the directory and take the name's lock (another chat holding it is an error)."""
        files.private_dir(self.dir, f"--resume {self.name}: the chat data directory")  # conversations: the user's only
        try:
            # never through a symlink planted under the lock's name (its target was truncated)
            f = os.fdopen(os.open(self.dir / f"{self.name}.lock",
                                  os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600), "a+")
        except OSError as e:
            raise DeltaserveError(f"--resume {self.name}: cannot use {self.dir} ({e.strerror})") from None
        try:
            import fcntl
        except ImportError:  # no advisory locks here: go on unguarded
            self._lock_file = f
            return
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            raise DeltaserveError(f"--resume {self.name}: this conversation is open in another deltaserve chat"
                                  + (f" (pid {holder})" if holder else "") + "; leave that one first") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._lock_file = f

    def load(self) -> dict | None:
        """The saved conversation, or None when there is none under this name. A file that cannot be read is an
        error, never overwritten: the messages in it are not ours to lose."""
        try:  # never through a symlink, never blocking on a FIFO planted under its name
            text = files.read_checked(self.json_path, MAX_CHAT_BYTES, private=False).decode("utf-8")
        except files.UnsafeFile as e:
            if e.kind == "missing":
                return None
            raise DeltaserveError(f"--resume {self.name}: {self.json_path} cannot be read ({e}); move it away or "
                                  f"pick another name") from None
        except (OSError, UnicodeDecodeError) as e:
            raise DeltaserveError(f"--resume {self.name}: {self.json_path} cannot be read ({e}); move it away or "
                                  f"pick another name") from None
        try:
            data = json.loads(text)
            ok = (isinstance(data, dict) and data.get("format") == CHAT_FORMAT
                  and isinstance(data.get("messages"), list)
                  and all(isinstance(m, dict) and m.get("role") in ("user", "assistant")
                          and isinstance(m.get("content"), str) for m in data["messages"])
                  and isinstance(data.get("system"), (str, type(None)))
                  and isinstance(data.get("thinking"), (bool, type(None))))
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            raise DeltaserveError(f"--resume {self.name}: {self.json_path} is not a saved deltaserve conversation "
                                  f"(damaged or written by something else); move it away or pick another name")
        return data

    def write(self, messages: list[dict], system: str | None, thinking: bool | None, model) -> None:
        data = {"format": CHAT_FORMAT, "name": self.name, "messages": messages, "system": system,
                "thinking": thinking, "model": model.path.name, "model_path": str(model.path),
                "model_sha256": model.host.sha256(), "deltaserve": __version__,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        text = json.dumps(data, ensure_ascii=False, indent=1) + "\n"
        # a temporary name of ours, created exclusively (never through a symlink, never a planted FIFO), then renamed
        files.write_atomic(self.json_path, text.encode("utf-8"), files.directory_key(self.dir))

    def drop_state(self) -> None:
        files.unlink_ours(self.state_path)


class ChatREPL:
    def __init__(self, model, session, sampling: dict, max_tokens: int, system: str | None, thinking: bool | None,
                 out=sys.stdout, saved: SavedChat | None = None, messages: list[dict] | None = None):
        self.model = model
        self.session = session
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.system = system
        self.thinking = thinking
        self.messages: list[dict] = list(messages or [])
        self.images: list[str] = []  # files /image attached to the next message
        self.out = out
        self.saved = saved                  # --resume NAME: written after every turn
        self.resumed: str | None = None     # what /stats says about the resume
        self.turns_since_resume = 0

    def conversation(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def read_message(self, first: str, read) -> str:
        if first.strip() == '"""' or (first.startswith('"""') and not first.rstrip().endswith('"""')):
            lines = [first.strip()[3:]] if first.strip() != '"""' else []
            while True:
                line = read("... ")
                if line.rstrip().endswith('"""'):
                    lines.append(line.rstrip()[:-3])
                    break
                lines.append(line)
            return "\n".join(lines).strip("\n")
        if first.startswith('"""') and first.rstrip().endswith('"""') and len(first.strip()) >= 6:
            return first.strip()[3:-3]
        lines = [first]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            lines.append(read("... "))
        return "\n".join(lines)

    def answer(self) -> None:
        """Generate the assistant's reply to the conversation as it stands, streaming it; what the model reasons
        first is shown apart, under [thinking], and never enters the history."""
        shown = {"reasoning": False}

        def on_reasoning(piece):
            if not shown["reasoning"]:
                self.out.write("[thinking] ")
                shown["reasoning"] = True
            self.out.write(piece)
            self.out.flush()

        def on_token(_tid, piece):
            if shown["reasoning"] is True:
                self.out.write("\n[/thinking]\n")
                shown["reasoning"] = "closed"
            self.out.write(piece)
            self.out.flush()

        turn = self.session.chat(self.conversation(), max_tokens=self.max_tokens, enable_thinking=self.thinking,
                                 on_token=on_token, on_reasoning=on_reasoning, **self.sampling)
        self.out.write("\n")
        self.messages.append({"role": "assistant", "content": turn.text})
        capped = ", cut by the context" if turn.context_capped else ""
        replay = f" | replayed {turn.replayed} on the CPU" if turn.replayed else ""
        self.out.write(f"[reused {turn.reused} | prefilled {turn.prefilled}{replay} | TTFT {turn.timings.ttft_s * 1000:.0f} ms | "
                       f"{turn.decode_tok_s:.1f} tok/s | {plural(turn.generated, 'token')}, {turn.finish_reason}{capped}"
                       + (f", MTP {turn.accepted}/{turn.drafted} drafts accepted" if turn.drafted else "")
                       + (f", {thought_words(turn)}" if thought_words(turn) else "")
                       + f" | {turn.start}]\n")
        self.out.flush()
        if self.resumed is not None and not self.turns_since_resume:
            self.resumed += f"; its first turn reused {turn.reused} tokens ({turn.start})"
        self.turns_since_resume += 1
        self.persist()

    def persist(self, state: bool = True) -> None:
        """Under --resume: the conversation to NAME.json and (`state`) the session's checkpoint to NAME.state, or
        (not `state`) NAME.state removed. A failure is said and the conversation goes on."""
        if self.saved is None:
            return
        try:
            self.saved.write(self.messages, self.system, self.thinking, self.model)
            if not state:
                self.saved.drop_state()
                return
            try:
                self.session.save(self.saved.state_path)
            except DeltaserveError:  # no checkpoint to save (nothing was prefilled): no stale state either
                self.saved.drop_state()
        except (OSError, DeltaserveError) as e:
            self.out.write(f"[deltaserve] could not save {self.saved.name} to {self.saved.dir}: {e}; the "
                           f"conversation goes on unsaved\n")
            self.out.flush()

    def command(self, line: str) -> bool:
        """Run a /command; False to quit."""
        name, _, arg = line[1:].partition(" ")
        name = name.lower()
        if name in ("quit", "exit", "q"):
            return False
        if name == "help":
            self.out.write(HELP + "\n")
        elif name == "clear":
            self.messages = []
            self.session.reset()
            self.persist(state=False)
            self.out.write(f"[cleared{f'; the saved conversation {self.saved.name} too' if self.saved else ''}]\n")
        elif name == "system":
            self.system = arg.strip() or None
            self.messages = []
            self.persist(state=False)
            self.out.write(f"[system message {'set' if self.system else 'removed'}; conversation cleared]\n")
        elif name == "regenerate":
            if not self.messages or self.messages[-1]["role"] != "assistant":
                self.out.write("[nothing to regenerate]\n")
            else:
                self.messages.pop()
                self.answer()
        elif name == "think":
            if arg.strip().lower() not in ("on", "off"):
                self.out.write("[usage: /think on|off]\n")
            else:
                self.thinking = arg.strip().lower() == "on"
                self.out.write(f"[thinking {'on' if self.thinking else 'off'}]\n")
                if self.saved is not None:
                    self.persist()
        elif name == "image":
            path = arg.strip()
            if not path:
                self.out.write("[usage: /image FILE]\n")
            else:
                from deltaserve.api import ImageInputError, decode

                try:
                    image = decode(path, allow_files=True)
                except ImageInputError as e:
                    self.out.write(f"[image not attached: {e}]\n")
                else:
                    if self.session.host.vision is None:
                        self.out.write("[image not attached: this model has no vision encoder (an HF checkpoint "
                                       "directory holding model.visual.* has one)]\n")
                    else:
                        self.images.append(path)
                        w, h = image.image.size
                        self.out.write(f"[image {path} ({w}x{h}) goes with your next message]\n")
        elif name == "stats":
            s = self.session
            self.out.write(f"[turns {s.turns} | held {len(s.held)} tokens | capacity {s.capacity} positions | "
                           f"checkpoint {s.checkpoint_length} | context {s.context} | backend {s.backend.name}]\n")
            if s.prefill_lines:
                self.out.write(f"  batched prefills: {s.batched_prefills}; last {s.prefill_lines[-1]}\n")
            for n in s.notices:
                self.out.write(f"  {n}\n")
            if self.saved is not None:
                self.out.write(f"  saved after every turn as {self.saved.name} ({self.saved.json_path}, .state)\n")
            if self.resumed is not None:
                self.out.write(f"  {self.resumed}\n")
        else:
            self.out.write(f"[unknown command /{name}; /help lists them]\n")
        self.out.flush()
        return True

    def loop(self, read=input) -> None:
        self.out.write("deltaserve chat: /help for commands, /quit to leave\n")
        self.out.flush()
        while True:
            try:
                line = read("> ")
            except EOFError:
                self.out.write("\n")
                return
            except KeyboardInterrupt:
                self.out.write("\n")
                return
            if not line.strip():
                continue
            if line.startswith("/"):
                if not self.command(line.strip()):
                    return
                continue
            text = self.read_message(line, read)
            content = [{"type": "image", "image": p} for p in self.images] + [{"type": "text", "text": text}] \
                if self.images else text
            self.images = []
            self.messages.append({"role": "user", "content": content})
            try:
                self.answer()
            except KeyboardInterrupt:
                self.out.write("\n[interrupted]\n")
                self.messages.pop()
            except DeltaserveError as e:
                self.messages.pop()
                self.out.write(f"[error: {e}]\n")
                self.out.flush()


def _thinking_flag(a) -> bool | None:
    """--think on|off|auto; auto (None) is the model's default, or under --resume the saved conversation's."""
    return thinking_flag(a.think)


def resume(a, model, saved: SavedChat) -> tuple[dict | None, list[str]]:
    """The saved conversation under --resume NAME (None: a new one) and what to say about it. A conversation
    saved with another model is refused, naming both: going on would rebind it to this model and write over the
    only state that model's next turn could resume from."""
    data = saved.load()
    if data is None:
        return None, [f"[deltaserve] {saved.name}: no saved conversation under this name: a new one, saved after "
                      f"every turn to {saved.json_path}"]
    sha = model.host.sha256()
    if data.get("model_sha256") != sha:
        theirs = data.get("model_path") or data.get("model")
        raise DeltaserveError(
            f"--resume {saved.name}: this conversation was saved with the model {theirs} "
            f"(sha256 {_short(data.get('model_sha256'))}) and this is {model.path} (sha256 {_short(sha)}); resume it "
            f"with that model, or start another name ({saved.json_path})")
    said = []
    if a.system is not None and a.system != data.get("system"):
        said.append(f"[deltaserve] {saved.name}: --system replaces the saved system message (the saved state, "
                    f"which follows the old one, will not be reused)")
    if _thinking_flag(a) is not None and _thinking_flag(a) != data.get("thinking"):
        said.append(f"[deltaserve] {saved.name}: --think {a.think} replaces the saved setting")
    return data, said


def restore_state(repl: ChatREPL, saved: SavedChat, data: dict) -> str:
    """Restore NAME.state into the session; the recap line. A refused file is one notice: the messages stay and
    the next turn prefills them in full."""
    n_msgs = plural(len(repl.messages), "message")
    if not saved.state_path.exists():
        repl.resumed = f"resumed {saved.name}: no saved state, the next turn prefills the conversation in full"
        return f"[deltaserve] resumed {saved.name}: {n_msgs}, no saved state (the next turn prefills in full)"
    try:
        n = repl.session.restore(saved.state_path)
        covered = tuple(json.loads(read_header(saved.state_path)["tokens"]))
    except (StateFileError, OSError, ValueError, KeyError) as e:
        repl.resumed = f"resumed {saved.name}: its state was refused ({e})"
        return (f"[deltaserve] resumed {saved.name}: {n_msgs}; its state file was refused ({e}): the next turn "
                f"prefills the conversation from its messages")
    ids, _ = repl.session.render(repl.conversation(), repl.thinking)
    if not (len(covered) < len(ids) and tuple(ids[:len(covered)]) == covered):
        repl.resumed = f"resumed {saved.name}: its state covers other tokens than these messages"
        return (f"[deltaserve] resumed {saved.name}: {n_msgs}; its state ({n} tokens) does not cover these "
                f"messages as rendered now: the next turn prefills them in full")
    repl.resumed = f"resumed {saved.name}: {n} tokens of state restored from {saved.state_path}"
    return f"[deltaserve] resumed {saved.name}: {n_msgs}, {n} tokens of state restored"


def main(a) -> int:
    saved = None
    if getattr(a, "resume", None):
        directory = chats_dir(getattr(a, "data_dir", None))
        for line in move_old_chats(directory):
            print(line, file=sys.stderr)
        saved = SavedChat(a.resume, directory)  # the name checked before anything is loaded
        saved.prepare()
    model = load_model(a)
    data, said = resume(a, model, saved) if saved is not None else (None, [])
    session = model.session(context=a.ctx, device=a.device, revalidate=a.revalidate,
                            guard_max_age=getattr(a, "guard_max_age", GUARD_MAX_AGE), mtp=getattr(a, "mtp", None),
                            loop_guard=loop_guard(a))
    c = model.config
    print(f"[deltaserve] {model.path.name}: {c.num_layers} layers, context {session.context}, loaded in "
          f"{model.load_seconds:.2f} s", file=sys.stderr)
    system, think = a.system, _thinking_flag(a)
    if data is not None:
        system = a.system if a.system is not None else data.get("system")
        think = think if think is not None else data.get("thinking")
    repl = ChatREPL(model, session, {**sampling_kwargs(a), **thinking_kwargs(a)}, a.max_tokens, system, think, saved=saved,
                    messages=data["messages"] if data is not None else None)
    for line in said:
        print(line, file=sys.stderr)
    if data is not None:
        print(restore_state(repl, saved, data), file=sys.stderr, flush=True)
    elif saved is not None:
        repl.resumed = f"{saved.name}: a new conversation"
    try:
        importlib.import_module("readline")  # line editing and history for input()
    except ImportError:
        pass
    repl.loop()
    return 0
