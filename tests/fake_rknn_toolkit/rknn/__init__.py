"""A fake rknn-toolkit2 for the converter's tests (see rknn/api)."""
