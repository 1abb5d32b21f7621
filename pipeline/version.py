"""The package version, in one place (read by the provenance and `--version`)."""

__version__ = "0.1.0"
