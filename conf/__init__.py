"""Hydra config groups, shipped inside the package (``pkg://specdraft.conf``).

Importing it (Hydra does, to read the configs) registers the resolvers the configs use:
``${path_component:…}`` (system/names.py), which refuses a run name that is not one directory name
before Hydra creates the run directory."""

from specdraft.system.names import register_resolver

register_resolver()
