"""Text: the tokenizer, the chat template, and streams of generated text (held-back markers, reasoning)."""
