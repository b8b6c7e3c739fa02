"""OpenAI-compatible HTTP/SSE gateway (specd.gateway). Built in a later issue."""
