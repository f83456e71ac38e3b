"""Training draft heads on a frozen target: losses, the multi-step rollout, the LightningModule and
the training entry point."""
