__version__ = "0.1.0"

# The hooks and interfaces plugins rely on, as "MAJOR.MINOR". A plugin declaring
# VFRAME_PLUGIN_API loads when the majors match and its minor is at most this one
# (vframe.plugins.versioning); docs/plugins.md "API versioning" says when each part
# changes and lists what every version added.
PLUGIN_API_VERSION = "1.23"
