"""Tuning databases applied by the build when present (package data)."""
