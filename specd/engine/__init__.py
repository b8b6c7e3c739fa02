"""The verifier engine, in rooms by role (docs/architecture.md, "Layout"):
- model/: the network (one Llama-family decoder, its attention over the paged KV cache, its matmul
  paths), its config and its weights;
- spec/: speculation (the speculator, the controller that picks k and the drafter, the proposer
  contract);
- here, the core step: sequences, KV blocks, the scheduler, the model runner, the sampler, loading
  with its self-test, and the loop (llm_engine.py), which wires the rooms together.
Arrows point one way (tests/unit/test_layering.py): the loop sits above the other rooms; spec
imports the core step's types and never the model; the core step imports the model and never spec;
the model imports nothing else of the engine.
"""
