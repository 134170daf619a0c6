"""The fedlink coordinator: gRPC api, protocol handling, domain, workflows, store and services."""
