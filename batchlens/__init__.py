"""The `batchlens` command line (`batchlens.cli`)."""
