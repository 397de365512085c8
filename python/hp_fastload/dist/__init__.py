"""Across ranks: the agreement protocol (a failure on any rank raises on every rank, naming it, with its class and
fields: ``agree``; ``bounded`` for steps that run the user's code), which peers are still there (``liveness``), the
checkpoint identity the ranks compare, object collectives for save, the sharing of replicated regions
(``share="replicated"``), and the group that carries host-memory messages (``groups``). Beside ``planning`` in the
layers: it never plans and planning never talks to other ranks; ``execute`` above calls both. Imports only
``model``, ``source`` and the bottom layers.
"""
