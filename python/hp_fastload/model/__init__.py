"""The model side: which tensors a checkpoint fills (targets, tied aliases), the global indices each rank holds of them
(local regions of DTensors on any mesh), module wrappers, what a load finishes (ties, buffers) and named parallel
layouts. Imports only ``source`` below it.
"""
