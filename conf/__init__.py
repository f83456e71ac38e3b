"""Hydra config groups, shipped inside the package (``pkg://specdraft.conf``)."""
