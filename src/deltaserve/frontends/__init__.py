"""Frontends: the command line, the interactive chat, the OpenAI-compatible server."""
