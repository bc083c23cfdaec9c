"""What the servers share: request validation for every surface, Triton model parameters, liveness."""
