"""The package version, in one leaf module that every layer may read."""

__version__ = "0.1.0"
