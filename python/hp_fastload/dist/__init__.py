"""Across ranks: the agreement protocol (a failure on any rank raises on every rank, naming it), the checkpoint
identity the ranks compare, object collectives for save, and the optional sharing of replicated regions. Imports
``execute`` and the layers below.
"""
