"""The model: one Llama-family decoder (decoder.py) and its parts (attention.py over the paged KV
cache, rotary.py, the matmul paths per device in linear.py and quant.py), its config (config.py),
a GGUF file's weights in their own types (gguf_weights.py) and the weights' fingerprint.

Imports nothing else of the engine: the core step (model_runner.py, loader.py and its self-test
exactness.py) and the loop use it; speculation never does.
"""
