"""Multi-rank tests: real gloo process groups (cross-rank agreement, sharing, job-wide delivery)."""
