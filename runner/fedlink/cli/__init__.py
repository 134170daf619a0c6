"""The ``fedlink`` command line: one click group, with the server's commands loaded only when installed."""
