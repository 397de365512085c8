"""Across ranks: the agreement protocol (a failure on any rank raises on every rank, naming it), the checkpoint
identity the ranks compare, object collectives for save, the optional sharing of replicated regions, and the
group that carries host-memory messages (``groups``). Imports ``execute`` and the layers below.
"""
