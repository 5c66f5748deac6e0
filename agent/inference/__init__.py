"""On-device inference: sessions, input sources and the serving loop."""
