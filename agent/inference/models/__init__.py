"""The bundled demo model (data only; see agent.inference.demo_model)."""
