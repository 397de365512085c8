"""Tests of the planning layer (pure: no files, no process group)."""
