"""The turn driver: one turn from its request to its events, the same for every frontend.

`prepare` is the input half's work that needs the model (a `TurnRequest` rendered with the model's template, or a
raw prompt, bounded against the context before it is tokenized, then encoded with its images' placeholder ids);
`run` drives a prepared turn on a session (the session submits it to the engine loop as one sequence) and hands out
the output half's events as they come: `Reasoning`, `Content`, `CallStart`, `CallArguments`, and a last `Finish`
(session/turns.py). The Python API (`Session.chat`, `Session.run_turn`), `run`, the REPL, the server (chat
completions, completions, Responses) and the Ray router's rendering all go through here; a frontend only frames the
events (OpenAI's chunks, Responses' items, the terminal).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from deltaserve.errors import ContextError, DeltaserveError
from deltaserve.session.grammar import CompiledFormat
from deltaserve.session.logprobs import MAX_TOP, Recorder  # noqa: F401 - MAX_TOP: the frontends' bound
from deltaserve.session.turns import Content, Event, Finish, TurnRequest
from deltaserve.text.chat_template import RenderedPrompt


@dataclass
class PreparedTurn:
    """A turn ready to run: its prompt ids, whether the prompt leaves the model reasoning, the request it came from
    (None: a raw prompt, whose answer is all content), what constrains the answer, and whether the turn's checkpoint
    is the state it ends with (`keep_end`: a conversation continued from exactly what the state holds)."""

    ids: list[int]
    thinking: bool = False
    request: TurnRequest | None = None
    grammar: CompiledFormat | None = None
    keep_end: bool = False

    @property
    def images(self) -> list:
        return self.request.images if self.request is not None else []


@dataclass
class Logprobs:
    """The log-probabilities of the token whose text the events after it carry (session/logprobs.py), handed out
    before them; a token whose text is held back (a tail that may begin a stop string or a call) comes out with a
    later token's events. `prompt`: the prompt's own (echo), handed out once, before the first token's."""

    entries: list
    prompt: bool = False


@dataclass
class Choice:
    """An event of choice `index`, in a turn of several choices (`run(..., n=...)`)."""

    index: int
    event: Any


class RawOutput:
    """The output half of a raw prompt (completions): every piece is content, nothing is parsed."""

    def __init__(self):
        self._content: list[str] = []

    def push(self, text: str) -> list[Event]:
        if not text:
            return []
        self._content.append(text)
        return [Content(text)]

    def finish(self, reason: str) -> list[Event]:
        return [Finish(reason, "".join(self._content), None)]


def check_prompt(prompt: Sequence[int], vocab_size: int, context: int, images: bool = False) -> None:
    """The one check of a prompt before a turn (the session's, and the server's before a request takes a slot):
    not empty, every id in the vocabulary (with `images`, an image's placeholder ids past it too:
    deltaserve.vision.inputs), and shorter than the context, or refused whole with the numbers."""
    n = len(prompt)
    if n == 0:
        raise ContextError("the prompt is empty: a turn needs at least one token")
    if min(prompt) < 0 or (max(prompt) >= vocab_size and not images):
        raise DeltaserveError(f"the prompt holds a token id outside 0..{vocab_size - 1}")
    if n >= context:
        raise ContextError(overflow_message(context, n))


def overflow_message(context: int, tokens: int, at_least: bool = False) -> str:
    """A prompt the context cannot hold, in the words OpenAI uses and client libraries match ("maximum context
    length": litellm's context-window fallbacks; "prompt is too long": langchain-openai's ContextOverflowError),
    then what deltaserve did."""
    return (f"This model's maximum context length is {context} tokens. However, your messages resulted in "
            f"{'at least ' if at_least else ''}{tokens} tokens. The prompt is too long: refused whole (nothing is "
            f"truncated; shorten the conversation, or leave room for the answer: it must be shorter than the context)")


def prepare(tokenizer, context: int, *, request: TurnRequest | None = None, raw: str | list[int] | None = None,
            default_thinking: bool | None = None, vision=None, vocab_size: int = 0,
            prompt: RenderedPrompt | None = None, images: bool = True) -> PreparedTurn:
    """A chat request (`request`) or a raw prompt (`raw`: text the client wrote whole, markup included, or token ids)
    as prompt ids. Text that surely cannot fit the context is refused before it is tokenized, from a lower bound on
    its token count (ContextError naming both numbers). `prompt`: the request already rendered (a continuation).
    `images` False: each image stays its one placeholder token (a router's view of the prompt, with no encoder)."""
    if isinstance(raw, list):
        return PreparedTurn(list(raw))
    if raw is not None:
        prompt, thinking = RenderedPrompt(raw), False
    else:
        prompt = prompt or request.prompt(tokenizer, default_thinking)
        thinking = prompt.thinking
    least = tokenizer.fewest_tokens(prompt.display)
    if least >= context:
        raise ContextError(overflow_message(context, least, at_least=True))
    if images and request is not None and request.images:  # each image's placeholder ids (vision.inputs)
        return PreparedTurn(request.encode(prompt, tokenizer, vision, vocab_size), thinking, request)
    return PreparedTurn(prompt.encode(tokenizer), thinking, request)


def run(session, turn: PreparedTurn, max_tokens: int = 256, on_event: Callable[[Event], Any] | None = None,
        cancel: threading.Event | None = None, stop=None, partition: str | None = None,
        thinking_budget: int | None = None, thinking_message: str | None = None, logprobs: int | None = None,
        echo: bool = False, n: int = 1, **sampling):
    """Drive a prepared turn on `session` to its end, handing each event to `on_event` as it comes (on the engine
    loop's thread: a sink that must not block); `on_event` returning False cancels the turn as `cancel` does. Returns
    the session's Turn with the output half's reasoning, answer text, calls and finish reason. A prompt that opens a
    thought thinks `thinking_budget` tokens at most (None: unlimited), then the closing, `thinking_message` first
    (session/thinking.py); its Turn says `reasoning_tokens` and `reasoning_ended`.

    `logprobs` (0 to 20; None: none): each generated token's log-probability and that many of its row's most likely
    tokens' (session/logprobs.py), handed out as a `Logprobs` event before the token's text events and kept in the
    Turn's `logprobs`; `echo`: the prompt's tokens' too (`turn.logprobs.prompt`).

    `n` > 1: as many choices, the prompt prefilled once and its state forked (session/forks.py); each event is then
    handed out as `Choice(index, event)`, and the Turn's `forks` are choices 1 to n - 1, each with its own output
    half's fields."""
    def output_half():
        return turn.request.output(turn.thinking) if turn.request is not None else RawOutput()

    outputs = [output_half() for _ in range(n)]
    recorders = [Recorder(logprobs, echo and i == 0) if logprobs is not None else None for i in range(n)]

    def hand_out(events, index: int = 0) -> bool | None:
        go = None
        for e in events:
            if on_event is not None and on_event(Choice(index, e) if n > 1 else e) is False:
                go = False
        return go

    def sink(index: int):
        output, recorder = outputs[index], recorders[index]

        def on_token(tid, piece):
            if recorder is not None and recorder.echo and not sent_prompt:
                sent_prompt.append(True)
                hand_out([Logprobs(list(recorder.prompt), prompt=True)], index)
            if recorder is not None and tid is not None and recorder.entries:
                hand_out([Logprobs([recorder.entries[-1]])], index)
            return hand_out(output.push(piece), index)
        return on_token

    sent_prompt: list = []
    forks = None
    if n > 1:
        from deltaserve.session.forks import Forks

        forks = Forks([sink(i) for i in range(1, n)], recorders[1:], cancel)
    result = session.generate(turn.ids, max_tokens=max_tokens, stop=stop, on_token=sink(0),
                              response_format=turn.grammar, keep_end=turn.keep_end, images=turn.images,
                              cancel=cancel, partition=partition, thinking_budget=thinking_budget,
                              thinking_message=thinking_message, logprobs=recorders[0], forks=forks, **sampling)
    if recorders[0] is not None and recorders[0].echo and not sent_prompt:  # an answer of no token: the prompt's
        hand_out([Logprobs(list(recorders[0].prompt), prompt=True)])
    for index, one in enumerate([result] + list(result.forks)):
        events = outputs[index].finish(one.finish_reason)
        if one.finish_reason != "cancelled":
            hand_out(events, index)  # what was held back (a tail that might have begun </think> or <tool_call>), and Finish
        done: Finish = events[-1]
        one.reasoning, one.text, one.tool_calls = done.reasoning, done.content or "", done.tool_calls
        one.finish_reason = done.reason
        one.logprobs = recorders[index]
        if one.logprobs is not None:
            one.logprobs.settle(len(one.tokens))
        one.schema_error = done.error
    return result
