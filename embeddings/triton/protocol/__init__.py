"""Python stubs for the Triton gRPC protocol, generated from protos/ by protos/generate.py."""
