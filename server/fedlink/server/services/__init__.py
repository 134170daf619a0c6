"""Background services of the coordinator: the job supervisor and maintenance loops."""
