"""Training: optimizer and schedules, precision, checkpoints, metrics, and the loop itself."""
