"""The inference data plane (``edge-agent serve``): the Open Inference Protocol over HTTP and
gRPC in front of a model repository."""
