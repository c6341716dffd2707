"""Scheduling a sweep: actors, placement, retries, bisection, the tail, the run's loop and progress."""
