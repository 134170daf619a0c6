"""The package version and the device protocol version."""

__version__ = "0.1.0"

#: The device protocol version this code speaks, "MAJOR.MINOR". Peers with another MAJOR are refused.
PROTOCOL_VERSION = "1.0"
