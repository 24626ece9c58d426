"""`deltaserve chat`: a conversation on one resident session.

Each turn renders the whole history with the model's template; the session prefills only what its state
does not already hold. Commands: /clear, /system TEXT, /regenerate, /think on|off, /stats, /help, /quit.
Multi-line input: end a line with a backslash to continue, or wrap a block in triple quotes.
"""

from __future__ import annotations

import importlib
import sys

from deltaserve.errors import DeltaserveError
from deltaserve.frontends.common import load_model, sampling_kwargs, thinking
from deltaserve.kernels.cpu import plural

HELP = """commands:
  /clear          forget the conversation (keeps the system message)
  /system TEXT    set the system message (clears the conversation)
  /regenerate     answer the last message again (resumes from the checkpoint)
  /think on|off   thinking in the chat template
  /stats          the session: held tokens, capacity, checkpoint, backend, notices
  /help           this text
  /quit           leave (also Ctrl-D)
multi-line: end a line with \\ to continue it, or wrap a block in \"\"\" ... \"\"\""""


class ChatREPL:
    def __init__(self, model, session, sampling: dict, max_tokens: int, system: str | None, thinking: bool | None,
                 out=sys.stdout):
        self.model = model
        self.session = session
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.system = system
        self.thinking = thinking
        self.messages: list[dict] = []
        self.out = out

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
        self.out.write(f"[reused {turn.reused} | prefilled {turn.prefilled} | TTFT {turn.timings.ttft_s * 1000:.0f} ms | "
                       f"{turn.decode_tok_s:.1f} tok/s | {plural(turn.generated, 'token')}, {turn.finish_reason}{capped} | "
                       f"{turn.start}]\n")
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
            self.out.write("[cleared]\n")
        elif name == "system":
            self.system = arg.strip() or None
            self.messages = []
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
        elif name == "stats":
            s = self.session
            self.out.write(f"[turns {s.turns} | held {len(s.held)} tokens | capacity {s.capacity} positions | "
                           f"checkpoint {s.checkpoint_length} | context {s.context} | backend {s.backend.name}]\n")
            for n in s.notices:
                self.out.write(f"  {n}\n")
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
            self.messages.append({"role": "user", "content": text})
            try:
                self.answer()
            except KeyboardInterrupt:
                self.out.write("\n[interrupted]\n")
                self.messages.pop()
            except DeltaserveError as e:
                self.messages.pop()
                self.out.write(f"[error: {e}]\n")
                self.out.flush()


def main(a) -> int:
    model = load_model(a)
    session = model.session(context=a.ctx, device=a.device, revalidate=a.revalidate)
    c = model.config
    print(f"[deltaserve] {model.path.name}: {c.num_layers} layers, context {session.context}, loaded in "
          f"{model.load_seconds:.2f} s", file=sys.stderr)
    repl = ChatREPL(model, session, sampling_kwargs(a), a.max_tokens, a.system, thinking(a))
    try:
        importlib.import_module("readline")  # line editing and history for input()
    except ImportError:
        pass
    repl.loop()
    return 0
