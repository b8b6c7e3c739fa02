"""specd.gateway: the OpenAI-compatible HTTP/SSE front of a verifier (`specd gateway`)."""
