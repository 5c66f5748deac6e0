"""A stand-in for rknn-toolkit-lite2's ``rknnlite`` (aarch64-only wheels), for the tests."""
