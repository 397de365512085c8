"""Conversions: the rules that turn checkpoint keys into model names and layouts (transformers v5 semantics), the load
groups they form, key templates, quantized-source records and detection, the symbolic tensor that traces layout
ops, and state-dict adapters run on it. Imports only the layers below it (``model``, ``source``, ``formats``,
``errors``).
"""
