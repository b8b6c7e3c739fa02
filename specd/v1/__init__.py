"""Generated gRPC stubs for protos/specd/v1 (regenerate with protos/generate.py; never edit by hand)."""
