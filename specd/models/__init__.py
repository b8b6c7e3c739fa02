"""Where a model comes from: the model store (the default pair, fetched once), GGUF files,
tokenizers, detokenizing and chat templates; the demo pair's paths."""
