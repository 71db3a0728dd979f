"""Package version (the on-disk format has its own integer version, see recsave.format.FORMAT_VERSION)."""
__version__ = "0.1.0"
