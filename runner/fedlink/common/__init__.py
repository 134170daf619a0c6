"""Code shared by the runner and the coordinator: errors, DXO and tensor encodings, versions."""
