"""Test vectors of the protocol (docs/protocol.md): JSON files written by `python -m tests.vectors.generate`."""
