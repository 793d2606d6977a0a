"""Logs, traces, GPU figures and progress bars."""
