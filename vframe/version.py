__version__ = "0.1.0"

# Plugins check this to know which hooks and interfaces they can rely on.
# Bumped in its major part when a hook or interface changes incompatibly.
PLUGIN_API_VERSION = "1.1"
