"""Fleet control: signed command envelopes, their checks, the controller, the command store."""
