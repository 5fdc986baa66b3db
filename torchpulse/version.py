"""The package version, in a module of its own: the agent's handshake and the daemon read it without
importing the package's `attach()` side."""

__version__ = "0.1.0"
