__version__ = "0.1.0"

# Bumped when a hook signature or interface contract changes incompatibly;
# PLUGINS.md's changelog says what changed in each version.
PLUGIN_API_VERSION = 1
