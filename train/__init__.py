"""Losses, multi-step rollout, the LightningModule and the training entry point (not yet built)."""
