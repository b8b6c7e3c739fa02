"""The verifier engine: model, paged KV cache, scheduler, runner, sampler, loop."""
