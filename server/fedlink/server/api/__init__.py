"""gRPC adapters: thin servicers that convert protobuf to domain calls and errors to status codes."""
