"""A conversation rendered with the model's chat template: the one place prompts are built from messages."""

from __future__ import annotations

from deltaserve.text.stream import opens_reasoning


def render_text(tokenizer, messages, enable_thinking: bool | None = None) -> str:
    """The prompt text of `messages` with the generation header added (`enable_thinking` None: the template's
    own default)."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=enable_thinking)


def render(tokenizer, messages, enable_thinking: bool | None = None) -> tuple[list[int], bool]:
    """The prompt ids of `messages` with the generation header added, and whether the prompt leaves the model
    inside a reasoning block."""
    text = render_text(tokenizer, messages, enable_thinking)
    return tokenizer.encode(text), opens_reasoning(text)
