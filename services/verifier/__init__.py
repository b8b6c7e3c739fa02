"""Verifier service: owns the target model, KV cache and batch loop (specd.verifier). Built in a later issue."""
