"""The control plane: the orchestrator, the lives of the stage workers (supervisor,
replicas, launchers, zygote) and the open requests."""
