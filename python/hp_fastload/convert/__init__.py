"""Conversions: the rules that turn checkpoint keys into model names and layouts (transformers v5 semantics), the load
groups they form, key templates, quantized-source records and detection, and the symbolic tensor that traces layout
ops. Imports only ``source`` and ``model``.
"""
