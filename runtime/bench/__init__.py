"""Serving benchmark: synthetic models and adapters, workload replay, metrics and plots."""
