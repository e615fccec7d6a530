"""Generated gRPC stubs of lockd.v1 (built from lockd/api/proto by setup.py)."""
