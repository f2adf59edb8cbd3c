"""An example third-party plugin for engine (see README.md)."""
