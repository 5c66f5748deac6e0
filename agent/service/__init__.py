"""The running agent: its composition root (``node``) and the parts it wires together."""
