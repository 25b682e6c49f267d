"""The package version and the record/key format version (imported by every layer, imports nothing)."""

__version__ = "0.2.0.dev0"

#: Version of the key scheme and record format. Bump it for any change that alters keys or bytes.
FORMAT_VERSION = 3
