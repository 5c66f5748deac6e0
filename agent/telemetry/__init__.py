"""Telemetry: what the device is doing, sampled, queued on disk and exported."""
