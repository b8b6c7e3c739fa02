"""specd: speculative decoding for LLM serving."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name):
    # Lazy so `import specd` (e.g. for the CLI's --help) does not pay for torch.
    if name in ("LLM", "RequestOutput"):
        from specd import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from specd.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
