"""The device protocol below the gRPC servicers; callable in-process (the simulation does)."""
