"""The output: result files, the manifest, telemetry tables, the lock."""
